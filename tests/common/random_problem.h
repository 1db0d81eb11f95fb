// Random host problems for the tests, and the error measure of docs/contract.md.
//
// A RandomProblem owns every buffer (std::vector) and exposes a flashkda::Problem whose
// pointers refer to them. Inputs follow docs/contract.md: q, k, v ~ N(0,1), g ~ N(0,1) (or a constant,
// or U(-8,8)), dt_bias ~ U(0,1) (or U(-8,8)), A_log ~ U(0,1), beta_logit ~ N(0,1), initial
// state N(0,1) (or N(0,1) * 1e3). The same spec and seed always give the same problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/problem.h"
#include "flashkda/flashkda.h"

namespace flashkda::testing {

enum class InitState { kNone, kNormal, kLarge };
enum class GateInput { kNormal, kConstant, kUniform8 };   // g ~ N(0,1), g = g_const, g ~ U(-8,8)
enum class DtBiasInput { kUnit, kWide };                  // U(0,1), U(-8,8)

struct ProblemSpec {
  int64_t H = 2, K = 128, V = 128;
  // Varlen (packed) batch when seqlens is non-empty: B = 1, T = sum(seqlens), cu_seqlens in
  // cu_seqlens_dtype. Otherwise a fixed-length batch of B rows of T tokens, no cu_seqlens.
  std::vector<int64_t> seqlens;
  DType cu_seqlens_dtype = DType::kI64;
  int64_t B = 1, T = 0;

  Gate gate = Gate::kSafe;
  float lower_bound = -5.0f;
  float scale = 0.0f;  // 0: K^-0.5

  InitState init = InitState::kNone;
  DType init_dtype = DType::kF32;
  bool final_state = true;
  DType final_dtype = DType::kF32;

  GateInput g_input = GateInput::kNormal;
  float g_const = 0.0f;
  DtBiasInput dt_bias_input = DtBiasInput::kUnit;

  uint64_t seed = 1;

  std::string describe() const;
};

class RandomProblem {
 public:
  explicit RandomProblem(const ProblemSpec& spec);
  RandomProblem(const RandomProblem&) = delete;
  RandomProblem& operator=(const RandomProblem&) = delete;

  const ProblemSpec& spec() const { return spec_; }
  Problem& problem() { return p_; }
  const Problem& problem() const { return p_; }

  size_t out_size() const { return out_.size(); }      // elements of out
  size_t state_size() const;                           // elements of one [N, H, V, K] state
  const uint16_t* out() const { return out_.data(); }
  const void* final_state() const;                      // nullptr when not requested

  // Owned buffers (public so that tests can edit inputs before running).
  std::vector<uint16_t> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias;
  std::vector<uint16_t> init_bf16, final_bf16;
  std::vector<float> init_f32, final_f32;
  std::vector<int64_t> cu64;
  std::vector<int32_t> cu32;

 private:
  void bind();

  ProblemSpec spec_;
  Problem p_;
  std::vector<uint16_t> out_;
};

// The contract's bar (docs/contract.md): rel_error of out and of the final state against the fp64
// oracle, at most this.
constexpr double kBar = 3e-3;

// ||x - ref||_2 / ||ref||_2 (with ||ref|| = 0: ||x||_2). Infinite when x holds NaN or Inf.
double rel_error(const double* ref, const double* x, size_t n);
double rel_error(const double* ref, const float* x, size_t n);
double rel_error(const double* ref, const uint16_t* x_bf16, size_t n);
// A state stored as bf16 or f32.
double rel_error(const double* ref, const void* x, DType dtype, size_t n);

// True when every element is finite.
bool all_finite(const uint16_t* x_bf16, size_t n);
bool all_finite(const void* x, DType dtype, size_t n);

}  // namespace flashkda::testing

namespace flashkda::testing {

// The contract's rule for non-finite inputs, on out [total, H, V] and the final state
// [N, H, V, K] (stored as bf16 or f32; nullptr when not written), against the oracle's `ref_*`:
// - wherever the oracle's element is NaN or Inf, ours is NaN or Inf too (never a silent number);
// - ours may be non-finite where the oracle is finite only within the 16-token chunk of the
//   same sequence and head where the oracle output has a non-finite element (the chunked form
//   mixes the tokens of a chunk), and, for the state, only in a (sequence, head) whose oracle
//   state has one;
// - on every (sequence, head) whose oracle out and state are all finite, the error is <= bar.
// Returns "" when the rule holds, else what broke it. `nonfinite_ref` (optional) receives the
// number of non-finite oracle elements, so a test can check it exercised the rule at all.
std::string non_finite_violation(const Problem& p, const double* ref_out, const uint16_t* out,
                                 const double* ref_state, const void* state, double bar,
                                 size_t* nonfinite_ref = nullptr);

}  // namespace flashkda::testing

namespace flashkda::testing {

// The inputs a test can plant a value in (NaN, Inf) with set_input_value.
enum class Input { kQ, kK, kV, kG, kBeta, kALog, kDtBias, kInitialState };
constexpr Input kAllInputs[] = {Input::kQ,    Input::kK,    Input::kV,      Input::kG,
                                Input::kBeta, Input::kALog, Input::kDtBias, Input::kInitialState};
const char* input_name(Input which);

// Sets one element: (token, head, channel) of q, k, v, g; (token, head) of beta; head of A_log;
// (head, channel) of dt_bias; element `channel` of sequence `token`, head `head` of the initial
// state (which the problem must have).
void set_input_value(RandomProblem& rp, Input which, int64_t token, int64_t head, int64_t channel, float value);

}  // namespace flashkda::testing

namespace flashkda::testing {

// The public-API arguments describing problem `p` (host or device pointers alike; state pools, the
// state layout and checkpoints included).
ForwardArgs to_forward_args(const Problem& p);

// The message of the Error that forward(a) on host tensors throws, after checking its code; ""
// (and a test failure) when it accepts the arguments or throws another code.
std::string refusal_message(const ForwardArgs& a, ErrorCode code = ErrorCode::kInvalidArgument);

}  // namespace flashkda::testing
