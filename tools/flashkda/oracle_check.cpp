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

// Row r of dst is row r of src, or row rows[r] when `rows` is given (the slots of a pool).
template <typename T, typename A>
void gather(const std::vector<T, A>& src, std::vector<T>& dst, int64_t outer, int64_t H,
            const std::vector<int64_t>& heads, int64_t inner, const char* name, const int32_t* rows = nullptr) {
  const int64_t hs = static_cast<int64_t>(heads.size());
  resize_or_throw(dst, outer * hs * inner,
                  std::string("the oracle check's copy of ") + name + " (" + std::to_string(hs) + " heads)");
  for (int64_t r = 0; r < outer; ++r) {
    const int64_t from = rows ? rows[r] : r;
    for (int64_t j = 0; j < hs; ++j)
      std::memcpy(dst.data() + (r * hs + j) * inner, src.data() + (from * H + heads[j]) * inner, inner * sizeof(T));
  }
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
  // With a pool, the start states of the first index set (what the checked call read).
  const int32_t* slots = in.spec.pool.enabled() ? in.state_indices[0].data() : nullptr;
  if (!in.initial_state.empty())
    gather(in.initial_state, x.initial_state, s.N, s.H, heads, s.V * s.K * dtype_size(s.state_dtype),
           "the initial state", slots);
  return x;
}

// The oracle's problem on a head slice: the first `tokens` tokens of every sequence (all of
// them, or with token states a prefix of each row of the batch form: rows strided over the slice).
Problem slice_problem(const HostInputs& in, const HeadSlice& x, int64_t hs, int64_t tokens) {
  const Shape& s = in.shape;
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
  if (tokens < s.T) {  // batch form only (no cu_seqlens)
    p.T = tokens;
    p.total_tokens = s.B * tokens;
    auto rows = [&](int64_t d) { return RowStrides{false, s.T * hs * d, hs * d, d}; };
    p.q_rows = p.k_rows = p.g_rows = rows(s.K);
    p.v_rows = rows(s.V);
    p.beta_rows = rows(1);
  }
  return p;
}

// The oracle's problem on the first `tokens` tokens of sequence n alone, one row from its initial
// state (the slice's), starting at token row `start`.
Problem prefix_problem(const HostInputs& in, const HeadSlice& x, int64_t hs, int64_t n, int64_t start,
                       int64_t tokens) {
  const Shape& s = in.shape;
  Problem p = slice_problem(in, x, hs, s.T);
  p.B = p.N = 1;
  p.T = p.total_tokens = tokens;
  p.cu_seqlens = nullptr;
  p.q += start * hs * s.K, p.k += start * hs * s.K, p.g += start * hs * s.K;
  p.v += start * hs * s.V, p.beta += start * hs;
  if (p.initial_state)
    p.initial_state = x.initial_state.data() + n * hs * s.V * s.K * dtype_size(s.state_dtype);
  return p;
}

// Sums of squares of rel = ||x - ref|| / ||ref||.
struct RelError {
  double diff = 0, norm = 0;
  void add(double got, double ref) {
    diff += (got - ref) * (got - ref);
    norm += ref * ref;
  }
};

double state_value(const void* state, DType dtype, size_t i) {
  if (dtype == DType::kF32) return static_cast<const float*>(state)[i];
  return bf16_to_float(static_cast<const uint16_t*>(state)[i]);
}

double relative(double diff, double ref) {
  if (std::isnan(diff) || std::isinf(diff)) return std::nan("");
  if (ref == 0.0) return diff == 0.0 ? 0.0 : std::nan("");
  return std::sqrt(diff / ref);
}

// The checkpoints checked: a middle one and the last.
std::vector<int64_t> checkpoint_columns(int64_t C) {
  if (C <= 0) return {};
  if (C == 1) return {0};
  return {(C - 1) / 2, C - 1};
}

// Checkpoint c of every sequence (that has one) against the oracle's final state on its first
// checkpoint_offsets[n, c] tokens; adds to `all` (err_state) and `alone`.
void check_checkpoints(const HostInputs& in, const HeadSlice& x, const std::vector<int64_t>& heads,
                       const float* checkpoint_state, const std::vector<int64_t>& columns, RelError& all,
                       RelError& alone) {
  const Shape& s = in.shape;
  const int64_t hs = static_cast<int64_t>(heads.size()), C = s.checkpoints, per_head = s.V * s.K;
  std::vector<double> ref_out, ref_state(hs * per_head);
  int64_t start = 0;  // the sequence's first token row
  for (int64_t n = 0; n < s.N; start += in.spec.seq_lens[n], ++n)
    for (int64_t c : columns) {
      const int64_t tokens = in.checkpoint_offsets[n * C + c];
      if (tokens < 0) continue;  // unused entry
      resize_or_throw(ref_out, tokens * hs * s.V, "the fp64 oracle's out on a checkpoint's prefix");
      oracle_forward(prefix_problem(in, x, hs, n, start, tokens), ref_out.data(), ref_state.data());
      for (int64_t j = 0; j < hs; ++j)
        for (int64_t i = 0; i < per_head; ++i) {
          const double got = checkpoint_state[((n * C + c) * s.H + heads[j]) * per_head + i];
          all.add(got, ref_state[j * per_head + i]);
          alone.add(got, ref_state[j * per_head + i]);
        }
    }
}

}  // namespace

bool OracleCheck::pass() const {
  if (heads.empty()) return true;
  const bool out_ok = out_rel <= kErrorBar;  // false for NaN
  const bool state_ok = !has_final_state || final_state_rel <= kErrorBar;
  const bool checkpoints_ok = checkpoint_columns.empty() || checkpoint_rel <= kErrorBar;
  return out_ok && state_ok && checkpoints_ok;
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
                                 const std::vector<int64_t>& heads, const float* checkpoint_state) {
  OracleCheck result;
  result.heads = heads;
  result.has_final_state = final_state != nullptr || checkpoint_state != nullptr;
  if (heads.empty()) return result;
  const auto start = std::chrono::steady_clock::now();

  const Shape& s = in.shape;
  const int64_t hs = static_cast<int64_t>(heads.size());
  const HeadSlice x = slice_heads(in, heads);

  // The oracle runs the (sequence, head) pairs on the machine's threads.
  std::vector<double> ref_out, ref_state;
  resize_or_throw(ref_out, s.total_tokens * hs * s.V, "the fp64 oracle's out (" + std::to_string(hs) + " heads)");
  resize_or_throw(ref_state, final_state ? s.N * hs * s.V * s.K : 0,
                  "the fp64 oracle's final state (" + std::to_string(hs) + " heads)");

  // W states per sequence: the final one, or with token states the one after each token t,
  // checked against the oracle's final state on the first t + 1 tokens.
  const int64_t W = s.written_per_sequence, per_head = s.V * s.K;
  RelError out_err, state_err;
  for (int64_t w = 0; w < W; ++w) {
    const int64_t tokens = in.spec.pool.token_states ? w + 1 : s.T;
    oracle_forward(slice_problem(in, x, hs, tokens), ref_out.data(), final_state ? ref_state.data() : nullptr);
    if (final_state)
      for (int64_t n = 0; n < s.N; ++n)
        for (int64_t j = 0; j < hs; ++j)
          for (int64_t i = 0; i < per_head; ++i)
            state_err.add(state_value(final_state, s.state_dtype, ((n * W + w) * s.H + heads[j]) * per_head + i),
                          ref_state[(n * hs + j) * per_head + i]);
  }
  RelError checkpoint_err;
  if (checkpoint_state) {
    result.checkpoint_columns = checkpoint_columns(s.checkpoints);
    check_checkpoints(in, x, heads, checkpoint_state, result.checkpoint_columns, state_err, checkpoint_err);
    result.checkpoint_rel = relative(checkpoint_err.diff, checkpoint_err.norm);
  }
  // The last run covered every token.
  for (int64_t t = 0; t < s.total_tokens; ++t)
    for (int64_t j = 0; j < hs; ++j)
      for (int64_t c = 0; c < s.V; ++c)
        out_err.add(bf16_to_float(out[(t * s.H + heads[j]) * s.V + c]), ref_out[(t * hs + j) * s.V + c]);
  result.out_rel = relative(out_err.diff, out_err.norm);
  result.final_state_rel = result.has_final_state ? relative(state_err.diff, state_err.norm) : 0.0;
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
