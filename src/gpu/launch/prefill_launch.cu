// Host side of the CUDA prefill path: workspace layout, grid choice, launches. No device
// allocation and no host synchronisation happen here.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "api/validate.h"
#include "gpu/gpu_backend.h"
#include "gpu/launch/tensor_map.h"
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

// Multiprocessors of the current device, read once per device (forward's host time is GPU
// idle time for a caller who waits on it).
int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    fail(ErrorCode::kCudaError, "cannot read the current device");
  if (device < kMaxDevices && cached[device].load(std::memory_order_relaxed) > 0)
    return cached[device].load(std::memory_order_relaxed);
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    fail(ErrorCode::kCudaError, "cannot read the multiprocessor count of the current device");
  if (device < kMaxDevices) cached[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// State-pass layout. The pass is a chain of dependent chunk steps per (sequence, head), so it
// needs many warps in flight; but every extra block per head re-reads that head's chunk records.
// Take the first layout, from most to least economical in bytes, that puts a block on at least
// half the multiprocessors and two warps on each; few heads end at 1x4 (4x the warps of 8x1,
// each with a quarter of the per-step work).
StateConfig choose_state_config(int64_t seq_heads, int sms) {
  constexpr StateConfig kConfigs[] = {{8, 1}, {4, 1}, {2, 2}};
  for (const StateConfig& c : kConfigs) {
    const int64_t blocks = seq_heads * (8 / c.value_slices);
    if (2 * blocks >= sms && blocks * c.value_slices * c.key_parts >= 2 * sms) return c;
  }
  return {1, 4};
}

// FLASHKDA_STATE_CONFIG=VxK (8x1, 4x1, 2x2, 1x4) overrides the choice: tests run every layout.
StateConfig state_config(int64_t seq_heads) {
  if (const char* forced = std::getenv("FLASHKDA_STATE_CONFIG")) {
    StateConfig c{0, 0};
    if (std::sscanf(forced, "%dx%d", &c.value_slices, &c.key_parts) == 2) return c;
    fail(ErrorCode::kInvalidArgument, "FLASHKDA_STATE_CONFIG: expected VxK such as 2x2, got '", forced, "'");
  }
  return choose_state_config(seq_heads, multiprocessor_count());
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
    PrepParams prep{p.q, p.k, p.g, p.beta, p.A_log, p.dt_bias, p.lower_bound, p.scale,
                    static_cast<int>(p.H), seqs, records};
    launch_prep(prep, num_chunk_slots(p.total_tokens, p.N), stream);
  }
  StateParams state{encode_token_rows_map(p.v, p.total_tokens, p.H, kChunk),
                    records,
                    static_cast<int>(p.H),
                    seqs,
                    p.initial_state,
                    p.initial_state_dtype == DType::kF32,
                    p.final_state,
                    p.final_state_dtype == DType::kF32,
                    p.out};
  launch_state(state, state_config(p.N * p.H), stream);
}

}  // namespace flashkda::gpu
