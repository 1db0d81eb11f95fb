#include "oracle_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "common/problem.h"
#include "cpu/oracle.h"

namespace flashkda::cli {
namespace {

// The inputs of the chosen heads, copied out of the [rows, H, D] tensors into [rows, Hs, D]
// ones, so that the oracle sees a problem of Hs heads (heads are independent).
struct HeadSlice {
  std::vector<uint16_t> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias;
  std::vector<unsigned char> initial_state;
};

template <typename T, typename A>
void gather(const std::vector<T, A>& src, std::vector<T>& dst, int64_t outer, int64_t H,
            const std::vector<int64_t>& heads, int64_t inner, const char* name) {
  const int64_t hs = static_cast<int64_t>(heads.size());
  resize_or_throw(dst, outer * hs * inner,
                  std::string("the oracle check's copy of ") + name + " (" + std::to_string(hs) + " heads)");
  for (int64_t r = 0; r < outer; ++r)
    for (int64_t j = 0; j < hs; ++j)
      std::memcpy(dst.data() + (r * hs + j) * inner, src.data() + (r * H + heads[j]) * inner, inner * sizeof(T));
}

HeadSlice slice_heads(const HostInputs& in, const std::vector<int64_t>& heads) {
  const Shape& s = in.shape;
  HeadSlice x;
  gather(in.q, x.q, s.total_tokens, s.H, heads, s.K, "q");
  gather(in.k, x.k, s.total_tokens, s.H, heads, s.K, "k");
  gather(in.v, x.v, s.total_tokens, s.H, heads, s.V, "v");
  gather(in.g, x.g, s.total_tokens, s.H, heads, s.K, "g");
  gather(in.beta, x.beta, s.total_tokens, s.H, heads, 1, "beta");
  gather(in.A_log, x.A_log, 1, s.H, heads, 1, "A_log");
  gather(in.dt_bias, x.dt_bias, 1, s.H, heads, s.K, "dt_bias");
  if (!in.initial_state.empty())
    gather(in.initial_state, x.initial_state, s.N, s.H, heads, s.V * s.K * dtype_size(s.state_dtype),
           "the initial state");
  return x;
}

double state_value(const void* state, DType dtype, size_t i) {
  if (dtype == DType::kF32) return static_cast<const float*>(state)[i];
  return bf16_to_float(static_cast<const uint16_t*>(state)[i]);
}

double relative(double diff, double ref) {
  if (std::isnan(diff) || std::isinf(diff)) return std::nan("");
  if (ref == 0.0) return diff == 0.0 ? 0.0 : std::nan("");
  return std::sqrt(diff / ref);
}

}  // namespace

bool OracleCheck::pass() const {
  if (heads.empty()) return true;
  const bool out_ok = out_rel <= kErrorBar;  // false for NaN
  const bool state_ok = !has_final_state || final_state_rel <= kErrorBar;
  return out_ok && state_ok;
}

std::vector<int64_t> pick_heads(int64_t H, int64_t count) {
  count = std::min(count, H);
  std::vector<int64_t> heads;
  if (count <= 0) return heads;
  if (count == 1) return {0};
  for (int64_t i = 0; i < count; ++i) heads.push_back(i * (H - 1) / (count - 1));
  return heads;
}

OracleCheck check_against_oracle(const HostInputs& in, const uint16_t* out, const void* final_state,
                                 const std::vector<int64_t>& heads) {
  OracleCheck result;
  result.heads = heads;
  result.has_final_state = final_state != nullptr;
  if (heads.empty()) return result;
  const auto start = std::chrono::steady_clock::now();

  const Shape& s = in.shape;
  const int64_t hs = static_cast<int64_t>(heads.size());
  const HeadSlice x = slice_heads(in, heads);
  Problem p;
  p.B = s.B, p.T = s.T, p.H = hs, p.K = s.K, p.V = s.V, p.N = s.N;
  p.total_tokens = s.total_tokens;
  p.q = x.q.data(), p.k = x.k.data(), p.v = x.v.data(), p.g = x.g.data(), p.beta = x.beta.data();
  p.A_log = x.A_log.data(), p.dt_bias = x.dt_bias.data();
  p.initial_state = x.initial_state.empty() ? nullptr : x.initial_state.data();
  p.initial_state_dtype = s.state_dtype;
  p.cu_seqlens = in.cu_seqlens.empty() ? nullptr : in.cu_seqlens.data();
  p.cu_seqlens_dtype = in.spec.cu_seqlens_dtype;
  p.lower_bound = in.spec.lower_bound;
  p.scale = in.spec.scale;
  p.gate = in.spec.gate;

  // The oracle runs the (sequence, head) pairs on the machine's threads.
  std::vector<double> ref_out, ref_state;
  resize_or_throw(ref_out, s.total_tokens * hs * s.V, "the fp64 oracle's out (" + std::to_string(hs) + " heads)");
  resize_or_throw(ref_state, final_state ? s.N * hs * s.V * s.K : 0,
                  "the fp64 oracle's final state (" + std::to_string(hs) + " heads)");
  oracle_forward(p, ref_out.data(), final_state ? ref_state.data() : nullptr);

  double diff_out = 0, norm_out = 0, diff_state = 0, norm_state = 0;
  for (int64_t t = 0; t < s.total_tokens; ++t)
    for (int64_t j = 0; j < hs; ++j)
      for (int64_t c = 0; c < s.V; ++c) {
        const double ref = ref_out[(t * hs + j) * s.V + c];
        const double got = bf16_to_float(out[(t * s.H + heads[j]) * s.V + c]);
        diff_out += (got - ref) * (got - ref);
        norm_out += ref * ref;
      }
  if (final_state) {
    const int64_t per_head = s.V * s.K;
    for (int64_t n = 0; n < s.N; ++n)
      for (int64_t j = 0; j < hs; ++j)
        for (int64_t i = 0; i < per_head; ++i) {
          const double ref = ref_state[(n * hs + j) * per_head + i];
          const double got = state_value(final_state, s.state_dtype, (n * s.H + heads[j]) * per_head + i);
          diff_state += (got - ref) * (got - ref);
          norm_state += ref * ref;
        }
  }
  result.out_rel = relative(diff_out, norm_out);
  result.final_state_rel = final_state ? relative(diff_state, norm_state) : 0.0;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

int64_t count_poisoned(const void* data, size_t bytes, DType dtype) {
  int64_t count = 0;
  if (dtype == DType::kF32) {
    const auto* p = static_cast<const uint32_t*>(data);
    for (size_t i = 0; i < bytes / 4; ++i) count += p[i] == 0xFFFFFFFFu;
  } else {
    const auto* p = static_cast<const uint16_t*>(data);
    for (size_t i = 0; i < bytes / 2; ++i) count += p[i] == 0xFFFFu;
  }
  return count;
}

}  // namespace flashkda::cli
