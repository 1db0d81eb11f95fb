// Which CUDA kernels run a call (CudaPlan in gpu_backend.h), and the recurrent kernel's launch.
#include <cuda_runtime.h>

#include <climits>
#include <cstdlib>
#include <cstring>

#include "common/fail.h"
#include "gpu/decode/recurrent_params.h"
#include "gpu/gpu_backend.h"
#include "gpu/launch/device_views.h"

namespace flashkda::gpu {
namespace {

// Up to this many tokens a sequence on average, a call is decode-shaped: the state's one read and
// one write are its whole cost, and the recurrent kernel streams them with no workspace and no
// second pass. Beyond it the chunked prefill's tensor-core chunks win.
constexpr int64_t kDecodeTokensPerSequence = 8;

// The chunked prefill reads q, k, g with 16-byte loads and v through a tensor map of token rows
// (token stride, head stride): a strided view qualifies when its rows are 16-byte aligned, its
// heads lie within a token's row (the tensor map's strides grow outwards) and, with several
// batch rows, these are evenly spaced (a [B, T] view is then one run of B T token rows). beta is
// read element by element, any strides. Other views take the recurrent kernel.
bool chunked_reads_rows(const Problem& p) {
  auto ok = [&](const uint16_t* data, const RowStrides& s) {
    if (s.dense) return true;
    const ActivationView a = activation_view(data, s, p, 128);  // strides of size-1 dimensions normalised
    return reinterpret_cast<uintptr_t>(data) % 16 == 0 && a.batch % 8 == 0 && a.token % 8 == 0 && a.head % 8 == 0 &&
           a.head >= 128 && a.token >= p.H * a.head && a.batch == p.T * a.token;
  };
  return ok(p.q, p.q_rows) && ok(p.k, p.k_rows) && ok(p.v, p.v_rows) && ok(p.g, p.g_rows);
}

// The first feature of `p` the chunked prefill does not implement yet, as the error a forced
// chunked run gives; nullptr when it takes the problem.
const char* chunked_prefill_lacks(const Problem& p) {
  if (p.token_state_indices) return "token_state_indices: the chunked prefill does not write per-token states";
  if (!chunked_reads_rows(p))
    return "q, k, v, g: the chunked prefill reads strided views only with 16-byte aligned rows, strides in "
           "multiples of 8 elements, the heads within a token's row and the batch rows evenly spaced";
  return nullptr;
}

// FLASHKDA_CUDA_KERNELS=chunked or =recurrent forces a choice (tests, benchmarks); unset or
// =auto: -1, the plan's own choice.
int forced_kernels() {
  const char* forced = std::getenv("FLASHKDA_CUDA_KERNELS");
  if (!forced || std::strcmp(forced, "auto") == 0) return -1;
  if (std::strcmp(forced, "chunked") == 0) return static_cast<int>(CudaPlan::Kernels::kChunkedPrefill);
  if (std::strcmp(forced, "recurrent") == 0) return static_cast<int>(CudaPlan::Kernels::kRecurrent);
  fail(ErrorCode::kInvalidArgument, "FLASHKDA_CUDA_KERNELS: expected 'chunked', 'recurrent' or 'auto', got '", forced,
       "'");
}

// Every row of q, k, v, g starts 8-byte aligned (4 bf16 columns at a time).
bool rows_aligned_for_vectors(const Problem& p) {
  auto ok = [](const void* data, const RowStrides& s) {
    return reinterpret_cast<uintptr_t>(data) % 8 == 0 &&
           (s.dense || (s.batch % 4 == 0 && s.token % 4 == 0 && s.head % 4 == 0));
  };
  return ok(p.q, p.q_rows) && ok(p.k, p.k_rows) && ok(p.v, p.v_rows) && ok(p.g, p.g_rows);
}

}  // namespace

CudaPlan plan_cuda(const Problem& p) {
  CudaPlan plan;
  const char* lacks = chunked_prefill_lacks(p);
  const bool decode_shaped = p.total_tokens <= kDecodeTokensPerSequence * p.N;
  const int forced = forced_kernels();
  if (forced == static_cast<int>(CudaPlan::Kernels::kChunkedPrefill) && lacks)
    fail(ErrorCode::kUnsupported, lacks, " (FLASHKDA_CUDA_KERNELS=chunked); unset it to run the recurrent kernel");
  const bool recurrent = forced >= 0 ? forced == static_cast<int>(CudaPlan::Kernels::kRecurrent) : lacks || decode_shaped;
  if (recurrent) {
    plan.kernels = CudaPlan::Kernels::kRecurrent;
    if (p.N * p.H * 8 > INT_MAX)  // a block per 16 value rows of a head
      fail(ErrorCode::kUnsupported, "q: the recurrent kernel takes fewer than 2^28 (sequence, head) pairs, got N * H = ",
           p.N * p.H);
    return plan;
  }
  plan.prefill = plan_prefill(p);
  return plan;
}

void cuda_forward(const Problem& p, const CudaPlan& plan, void* workspace, cudaStream_t stream) {
  if (plan.kernels == CudaPlan::Kernels::kRecurrent) recurrent_forward(p, stream);
  else prefill_forward(p, plan.prefill, workspace, stream);
}

void recurrent_forward(const Problem& p, cudaStream_t stream) {
  RecurrentParams r{};
  r.q = activation_view(p.q, p.q_rows, p, p.K);
  r.k = activation_view(p.k, p.k_rows, p, p.K);
  r.v = activation_view(p.v, p.v_rows, p, p.V);
  r.g = activation_view(p.g, p.g_rows, p, p.K);
  r.beta = activation_view(p.beta, p.beta_rows, p, 1);
  r.vector_loads = rows_aligned_for_vectors(p);
  r.same_row_strides = r.q.same_strides(r.k) && r.q.same_strides(r.v) && r.q.same_strides(r.g);  // dense: always (K = V)
  r.A_log = p.A_log;
  r.dt_bias = p.dt_bias;
  r.num_heads = static_cast<int>(p.H);
  r.seqs = {p.cu_seqlens, p.cu_seqlens_dtype == DType::kI32, p.T, p.N, p.total_tokens};
  r.initial_state = p.initial_state;
  r.initial_bf16 = p.initial_state_dtype == DType::kBF16;
  r.final_state = p.final_state;
  r.final_bf16 = p.final_state_dtype == DType::kBF16;
  r.slots = state_slot_table(p);
  r.token_indices = index_view(p.token_state_indices, p.token_state_indices_dtype);
  r.token_columns = p.token_state_columns;
  r.checkpoints = checkpoint_table(p);
  r.out = p.out;
  r.out_aliases_input = p.out == p.q || p.out == p.k || p.out == p.v || p.out == p.g;
  r.lower_bound = p.lower_bound;
  r.scale = p.scale;
  r.softplus_gate = p.gate == Gate::kSoftplus;
  launch_recurrent(r, p.state_layout, stream);
}

}  // namespace flashkda::gpu
