// Host side of the CUDA prefill path: workspace layout, grid choice, launches. No device
// allocation and no host synchronisation happen here.
#include <cuda_runtime.h>

#include "api/validate.h"
#include "gpu/gpu_backend.h"
#include "gpu/prefill/kernels.h"

namespace flashkda::gpu {
namespace {

SequenceTable sequence_table(const Problem& p) {
  SequenceTable t;
  t.cu_seqlens = p.cu_seqlens;
  t.cu_seqlens_i32 = p.cu_seqlens_dtype == DType::kI32;
  t.fixed_len = p.T;
  t.num_seqs = p.N;
  t.total_tokens = p.total_tokens;
  return t;
}

int multiprocessor_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    fail(ErrorCode::kCudaError, "cannot read the multiprocessor count of the current device");
  return sms;
}

// Warps per state-pass block. Fewer warps per block means more blocks (more SMs working on the
// sequential chain) at the price of reading each chunk record once per block: take the largest
// block that still gives every multiprocessor at least one block.
int choose_state_warps(int64_t seq_heads, int sms) {
  for (int warps = 8; warps > 1; warps /= 2)
    if (seq_heads * (8 / warps) >= sms) return warps;
  return 1;
}

}  // namespace

size_t prefill_workspace_size(const Problem& p) {
  return static_cast<size_t>(num_chunk_slots(p.total_tokens, p.N) * p.H) * ChunkRecord::kBytes;
}

void prefill_forward(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.gate != Gate::kSafe)
    fail(ErrorCode::kUnsupported, "gate: the CUDA path implements the safe gate only");
  if (p.K != kHeadDim || p.V != kHeadDim)
    fail(ErrorCode::kUnsupported, "the CUDA path implements K = V = 128 only, got K = ", p.K, ", V = ", p.V);
  if (workspace_bytes < prefill_workspace_size(p))
    fail(ErrorCode::kInvalidArgument, "workspace: expected at least ", prefill_workspace_size(p), " bytes, got ",
         workspace_bytes);
  if (p.N == 0) return;

  const SequenceTable seqs = sequence_table(p);
  auto* records = static_cast<uint8_t*>(workspace);
  if (p.total_tokens > 0) {
    PrepParams prep{p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.lower_bound, p.scale,
                    static_cast<int>(p.H), seqs, records};
    launch_prep(prep, num_chunk_slots(p.total_tokens, p.N), stream);
  }
  StateParams state{records,
                    static_cast<int>(p.H),
                    seqs,
                    p.initial_state,
                    p.initial_state_dtype == DType::kF32,
                    p.final_state,
                    p.final_state_dtype == DType::kF32,
                    p.out};
  launch_state(state, choose_state_warps(p.N * p.H, multiprocessor_count()), stream);
}

}  // namespace flashkda::gpu
