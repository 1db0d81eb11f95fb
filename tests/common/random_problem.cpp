#include "common/random_problem.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>

#include "common/bf16.h"

namespace flashkda::testing {
namespace {

void fill_normal(std::vector<uint16_t>& x, std::mt19937_64& rng, double mult = 1.0) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& e : x) e = float_to_bf16(static_cast<float>(dist(rng) * mult));
}

void fill_uniform(std::vector<float>& x, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (auto& e : x) e = dist(rng);
}

template <typename Acc>
double rel_error_impl(const double* ref, size_t n, const Acc& at) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = at(i);
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    num += (x - ref[i]) * (x - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0.0) return std::sqrt(num);
  return std::sqrt(num / den);
}

}  // namespace

std::string ProblemSpec::describe() const {
  std::ostringstream os;
  os << "H=" << H << " K=" << K << " V=" << V;
  if (!seqlens.empty()) {
    os << " seqlens=[";
    for (size_t i = 0; i < seqlens.size(); ++i) os << (i ? "," : "") << seqlens[i];
    os << "] cu=" << dtype_name(cu_seqlens_dtype);
  } else {
    os << " B=" << B << " T=" << T;
  }
  os << " gate=" << (gate == Gate::kSafe ? "safe" : "softplus") << " lb=" << lower_bound;
  os << " init=" << (init == InitState::kNone ? "none" : init == InitState::kNormal ? "N(0,1)" : "1e3");
  if (init != InitState::kNone) os << "/" << dtype_name(init_dtype);
  os << " final=" << (final_state ? dtype_name(final_dtype) : "none");
  os << " g=" << (g_input == GateInput::kNormal ? "N(0,1)"
                  : g_input == GateInput::kUniform8 ? "U(-8,8)" : "const");
  if (g_input == GateInput::kConstant) os << "(" << g_const << ")";
  os << " dt_bias=" << (dt_bias_input == DtBiasInput::kUnit ? "U(0,1)" : "U(-8,8)");
  os << " seed=" << seed;
  return os.str();
}

RandomProblem::RandomProblem(const ProblemSpec& spec) : spec_(spec) {
  Problem& p = p_;
  p.H = spec.H;
  p.K = spec.K;
  p.V = spec.V;
  if (!spec.seqlens.empty()) {
    p.B = 1;
    p.N = static_cast<int64_t>(spec.seqlens.size());
    cu64.assign(1, 0);
    for (int64_t len : spec.seqlens) cu64.push_back(cu64.back() + len);
    p.T = cu64.back();
    if (spec.cu_seqlens_dtype == DType::kI32) cu32.assign(cu64.begin(), cu64.end());
  } else {
    p.B = spec.B;
    p.T = spec.T;
    p.N = spec.B;
  }
  p.total_tokens = p.B * p.T;
  p.gate = spec.gate;
  p.lower_bound = spec.lower_bound;
  p.scale = spec.scale > 0.0f ? spec.scale : static_cast<float>(1.0 / std::sqrt(double(spec.K)));

  std::mt19937_64 rng(spec.seed);
  const size_t TH = static_cast<size_t>(p.total_tokens * p.H);
  q.resize(TH * p.K);
  k.resize(TH * p.K);
  v.resize(TH * p.V);
  g.resize(TH * p.K);
  beta.resize(TH);
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  switch (spec.g_input) {
    case GateInput::kNormal: fill_normal(g, rng); break;
    case GateInput::kConstant:
      for (auto& e : g) e = float_to_bf16(spec.g_const);
      break;
    case GateInput::kUniform8: {
      std::vector<float> tmp(g.size());
      fill_uniform(tmp, rng, -8.0f, 8.0f);
      for (size_t i = 0; i < g.size(); ++i) g[i] = float_to_bf16(tmp[i]);
      break;
    }
  }
  fill_normal(beta, rng);
  A_log.resize(p.H);
  fill_uniform(A_log, rng, 0.0f, 1.0f);
  dt_bias.resize(p.H * p.K);
  if (spec.dt_bias_input == DtBiasInput::kUnit)
    fill_uniform(dt_bias, rng, 0.0f, 1.0f);
  else
    fill_uniform(dt_bias, rng, -8.0f, 8.0f);

  const size_t S = state_size();
  if (spec.init != InitState::kNone) {
    const double mult = spec.init == InitState::kLarge ? 1e3 : 1.0;
    std::normal_distribution<double> dist(0.0, 1.0);
    if (spec.init_dtype == DType::kBF16) {
      init_bf16.resize(S);
      for (auto& e : init_bf16) e = float_to_bf16(static_cast<float>(dist(rng) * mult));
    } else {
      init_f32.resize(S);
      for (auto& e : init_f32) e = static_cast<float>(dist(rng) * mult);
    }
  }
  if (spec.final_state) {
    if (spec.final_dtype == DType::kBF16)
      final_bf16.assign(S, 0x7fc0);  // NaN: catches elements that are never written
    else
      final_f32.assign(S, std::numeric_limits<float>::quiet_NaN());
  }
  out_.assign(TH * p.V, 0x7fc0);
  bind();
}

void RandomProblem::bind() {
  Problem& p = p_;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.g = g.data();
  p.beta = beta.data();
  p.A_log = A_log.data();
  p.dt_bias = dt_bias.data();
  p.initial_state = nullptr;
  if (!init_bf16.empty()) {
    p.initial_state = init_bf16.data();
    p.initial_state_dtype = DType::kBF16;
  } else if (!init_f32.empty()) {
    p.initial_state = init_f32.data();
    p.initial_state_dtype = DType::kF32;
  }
  p.final_state = nullptr;
  if (!final_bf16.empty()) {
    p.final_state = final_bf16.data();
    p.final_state_dtype = DType::kBF16;
  } else if (!final_f32.empty()) {
    p.final_state = final_f32.data();
    p.final_state_dtype = DType::kF32;
  }
  p.cu_seqlens = nullptr;
  if (!spec_.seqlens.empty()) {
    if (spec_.cu_seqlens_dtype == DType::kI32) {
      p.cu_seqlens = cu32.data();
      p.cu_seqlens_dtype = DType::kI32;
    } else {
      p.cu_seqlens = cu64.data();
      p.cu_seqlens_dtype = DType::kI64;
    }
  }
  p.out = out_.data();
}

size_t RandomProblem::state_size() const {
  return static_cast<size_t>(p_.N * p_.H * p_.V * p_.K);
}

const void* RandomProblem::final_state() const { return p_.final_state; }

double rel_error(const double* ref, const double* x, size_t n) {
  return rel_error_impl(ref, n, [&](size_t i) { return x[i]; });
}

double rel_error(const double* ref, const float* x, size_t n) {
  return rel_error_impl(ref, n, [&](size_t i) { return double(x[i]); });
}

double rel_error(const double* ref, const uint16_t* x_bf16, size_t n) {
  return rel_error_impl(ref, n, [&](size_t i) { return double(bf16_to_float(x_bf16[i])); });
}

double rel_error(const double* ref, const void* x, DType dtype, size_t n) {
  if (dtype == DType::kBF16) return rel_error(ref, static_cast<const uint16_t*>(x), n);
  return rel_error(ref, static_cast<const float*>(x), n);
}

bool all_finite(const uint16_t* x_bf16, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(bf16_to_float(x_bf16[i]))) return false;
  return true;
}

bool all_finite(const void* x, DType dtype, size_t n) {
  if (dtype == DType::kBF16) return all_finite(static_cast<const uint16_t*>(x), n);
  const float* f = static_cast<const float*>(x);
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(f[i])) return false;
  return true;
}

}  // namespace flashkda::testing

namespace flashkda::testing {

std::string non_finite_violation(const Problem& p, const double* ref_out, const uint16_t* out,
                                 const double* ref_state, const void* state, double bar, size_t* nonfinite_ref) {
  constexpr int64_t kChunk = 16;
  const int64_t H = p.H, V = p.V, K = p.K;
  const std::vector<int64_t> offsets = host_sequence_offsets(p);
  const auto state_at = [&](size_t i) {
    return p.final_state_dtype == DType::kBF16 ? double(bf16_to_float(static_cast<const uint16_t*>(state)[i]))
                                               : double(static_cast<const float*>(state)[i]);
  };
  size_t bad_ref = 0;
  std::ostringstream why;
  for (int64_t n = 0; n < p.N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      bool pair_finite = true;
      double num = 0.0, den = 0.0;
      for (int64_t c0 = offsets[n]; c0 < offsets[n + 1]; c0 += kChunk) {
        const int64_t c1 = std::min(c0 + kChunk, offsets[n + 1]);
        bool chunk_ref_nonfinite = false;
        for (int64_t t = c0; t < c1; ++t)
          for (int64_t j = 0; j < V; ++j) chunk_ref_nonfinite |= !std::isfinite(ref_out[(t * H + h) * V + j]);
        pair_finite &= !chunk_ref_nonfinite;
        for (int64_t t = c0; t < c1; ++t)
          for (int64_t j = 0; j < V; ++j) {
            const size_t i = static_cast<size_t>((t * H + h) * V + j);
            const bool ref_ok = std::isfinite(ref_out[i]);
            const double x = bf16_to_float(out[i]);
            const bool ours_ok = std::isfinite(x);
            bad_ref += !ref_ok;
            if (!ref_ok && ours_ok) {
              why << "out[token " << t << ", head " << h << ", " << j << "] = " << x << " where the oracle has "
                  << ref_out[i];
              return why.str();
            }
            if (ref_ok && !ours_ok && !chunk_ref_nonfinite) {
              why << "out[token " << t << ", head " << h << ", " << j << "] is " << x
                  << " where the oracle's whole chunk is finite";
              return why.str();
            }
            num += (x - ref_out[i]) * (x - ref_out[i]);
            den += ref_out[i] * ref_out[i];
          }
      }
      bool state_ref_nonfinite = false;
      double snum = 0.0, sden = 0.0;
      if (state) {
        const size_t base = static_cast<size_t>((n * H + h) * V * K);
        for (size_t i = base; i < base + static_cast<size_t>(V * K); ++i) state_ref_nonfinite |= !std::isfinite(ref_state[i]);
        for (size_t i = base; i < base + static_cast<size_t>(V * K); ++i) {
          const bool ref_ok = std::isfinite(ref_state[i]);
          const double x = state_at(i);
          bad_ref += !ref_ok;
          if (!ref_ok && std::isfinite(x)) {
            why << "final_state[seq " << n << ", head " << h << ", element " << i - base << "] = " << x
                << " where the oracle has " << ref_state[i];
            return why.str();
          }
          if (!std::isfinite(x) && !state_ref_nonfinite) {
            why << "final_state[seq " << n << ", head " << h << "] holds " << x << " where the oracle's state is finite";
            return why.str();
          }
          snum += (x - ref_state[i]) * (x - ref_state[i]);
          sden += ref_state[i] * ref_state[i];
        }
      }
      if (pair_finite && !state_ref_nonfinite) {
        const double e_out = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        const double e_state = sden > 0 ? std::sqrt(snum / sden) : std::sqrt(snum);
        if (!(e_out <= bar) || !(e_state <= bar)) {
          why << "seq " << n << ", head " << h << " (all finite in the oracle): rel error out " << e_out << ", state "
              << e_state << " above " << bar;
          return why.str();
        }
      }
    }
  }
  if (nonfinite_ref) *nonfinite_ref = bad_ref;
  return "";
}

}  // namespace flashkda::testing

namespace flashkda::testing {

const char* input_name(Input which) {
  switch (which) {
    case Input::kQ: return "q";
    case Input::kK: return "k";
    case Input::kV: return "v";
    case Input::kG: return "g";
    case Input::kBeta: return "beta";
    case Input::kALog: return "A_log";
    case Input::kDtBias: return "dt_bias";
    case Input::kInitialState: return "initial_state";
  }
  return "?";
}

void set_input_value(RandomProblem& rp, Input which, int64_t token, int64_t head, int64_t channel, float value) {
  const ProblemSpec& s = rp.spec();
  const size_t qk = static_cast<size_t>((token * s.H + head) * s.K + channel);
  switch (which) {
    case Input::kQ: rp.q[qk] = float_to_bf16(value); break;
    case Input::kK: rp.k[qk] = float_to_bf16(value); break;
    case Input::kG: rp.g[qk] = float_to_bf16(value); break;
    case Input::kV: rp.v[static_cast<size_t>((token * s.H + head) * s.V + channel)] = float_to_bf16(value); break;
    case Input::kBeta: rp.beta[static_cast<size_t>(token * s.H + head)] = float_to_bf16(value); break;
    case Input::kALog: rp.A_log[static_cast<size_t>(head)] = value; break;
    case Input::kDtBias: rp.dt_bias[static_cast<size_t>(head * s.K + channel)] = value; break;
    case Input::kInitialState: {
      const size_t i = static_cast<size_t>((token * s.H + head) * s.V * s.K + channel);
      if (s.init_dtype == DType::kBF16) rp.init_bf16[i] = float_to_bf16(value);
      else rp.init_f32[i] = value;
      break;
    }
  }
}

}  // namespace flashkda::testing

namespace flashkda::testing {

ForwardArgs to_forward_args(const Problem& p) {
  ForwardArgs a;
  a.q = make_tensor(p.q, DType::kBF16, p.B, p.T, p.H, p.K);
  a.k = make_tensor(p.k, DType::kBF16, p.B, p.T, p.H, p.K);
  a.v = make_tensor(p.v, DType::kBF16, p.B, p.T, p.H, p.V);
  a.g = make_tensor(p.g, DType::kBF16, p.B, p.T, p.H, p.K);
  a.beta = make_tensor(p.beta, DType::kBF16, p.B, p.T, p.H);
  a.A_log = make_tensor(p.A_log, DType::kF32, p.H);
  a.dt_bias = make_tensor(p.dt_bias, DType::kF32, p.H, p.K);
  a.out = make_tensor(p.out, DType::kBF16, p.B, p.T, p.H, p.V);
  const bool k_major = p.state_layout == StateLayout::kKV;
  const int64_t d1 = k_major ? p.K : p.V, d2 = k_major ? p.V : p.K;
  const int64_t initial_slots = p.state_indices ? p.initial_slots : p.N;
  const int64_t final_slots = p.state_indices ? p.final_slots : p.N;
  if (p.initial_state) a.initial_state = make_tensor(p.initial_state, p.initial_state_dtype, initial_slots, p.H, d1, d2);
  if (p.final_state) a.final_state = make_tensor(p.final_state, p.final_state_dtype, final_slots, p.H, d1, d2);
  if (p.cu_seqlens) a.cu_seqlens = make_tensor(p.cu_seqlens, p.cu_seqlens_dtype, p.N + 1);
  if (p.state_indices) a.state_indices = make_tensor(p.state_indices, p.state_indices_dtype, p.N);
  if (p.final_state_indices)
    a.final_state_indices = make_tensor(p.final_state_indices, p.final_state_indices_dtype, p.N);
  a.state_layout = p.state_layout;
  if (p.checkpoint_offsets)
    a.checkpoint_offsets = make_tensor(p.checkpoint_offsets, p.checkpoint_offsets_dtype, p.N, p.checkpoints);
  if (p.checkpoint_state) a.checkpoint_state = make_tensor(p.checkpoint_state, DType::kF32, p.N, p.checkpoints, p.H, d1, d2);
  if (p.token_state_indices)
    a.token_state_indices = make_tensor(p.token_state_indices, p.token_state_indices_dtype, p.N, p.token_state_columns);
  a.lower_bound = p.lower_bound;
  a.scale = p.scale;
  a.gate = p.gate;
  return a;
}

}  // namespace flashkda::testing

namespace flashkda::testing {

std::string refusal_message(const ForwardArgs& a, ErrorCode code) {
  try {
    forward(a, nullptr, 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "forward accepted the arguments";
  return "";
}

}  // namespace flashkda::testing
