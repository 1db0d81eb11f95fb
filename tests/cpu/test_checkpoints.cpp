// Prefix checkpoints on the CPU backend, through the public API: the state after the first c
// tokens of a sequence equals, bit for bit, the final state of a prefill of those c tokens from
// the same initial state (and the fp64 oracle's within the bar); bad offsets are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/random_problem.h"
#include "common/run_forward.h"
#include "cpu/oracle.h"

namespace flashkda {
namespace {

using testing::InitState;
using testing::ProblemSpec;
using testing::RandomProblem;
using testing::rel_error;
using ::testing::HasSubstr;

using testing::kBar;

// The final state (fp32, V-major [H, V, K]) of a prefill of the first `tokens` tokens of
// sequence n of `base`, from the same initial state.
std::vector<float> prefix_final_state(const Problem& base, int64_t n, int64_t tokens) {
  const std::vector<int64_t> offsets = host_sequence_offsets(base);
  const int64_t bos = offsets[n], H = base.H, K = base.K, V = base.V;
  Problem p = base;
  const int64_t cu[] = {0, tokens};
  p.B = 1, p.T = tokens, p.N = 1, p.total_tokens = tokens;
  p.q = base.q + bos * H * K, p.k = base.k + bos * H * K, p.g = base.g + bos * H * K;
  p.v = base.v + bos * H * V, p.beta = base.beta + bos * H;
  p.cu_seqlens = cu, p.cu_seqlens_dtype = DType::kI64;
  std::vector<uint16_t> out(static_cast<size_t>(std::max<int64_t>(tokens, 1) * H * V));
  p.out = out.data();
  const size_t state_bytes = dtype_size(base.initial_state_dtype) * static_cast<size_t>(H * V * K);
  if (base.initial_state) p.initial_state = static_cast<const unsigned char*>(base.initial_state) + n * state_bytes;
  std::vector<float> final_state(static_cast<size_t>(H * V * K));
  p.final_state = final_state.data(), p.final_state_dtype = DType::kF32;
  p.checkpoint_offsets = nullptr, p.checkpoint_state = nullptr, p.checkpoints = 0;
  if (p.initial_state && p.initial_state_dtype == DType::kF32) {  // final_state must match its dtype
    testing::run_forward(testing::to_forward_args(p));
  } else {
    p.initial_state_dtype = base.initial_state_dtype;
    ForwardArgs a = testing::to_forward_args(p);
    const int64_t at[] = {tokens};  // outlives the call below
    if (p.initial_state) {  // a bf16 initial state: take the fp32 state out through a checkpoint at `tokens`
      a.final_state = Tensor{};
      a.checkpoint_offsets = make_tensor(at, DType::kI64, 1, 1);
      a.checkpoint_state = make_tensor(final_state.data(), DType::kF32, 1, 1, H, V, K);
    }
    testing::run_forward(a);
  }
  return final_state;
}

struct CheckpointRun {
  std::vector<int64_t> offsets;  // [N, C]
  std::vector<float> states;     // [N, C, H, V, K]
};

CheckpointRun run_with_checkpoints(RandomProblem& rp, const std::vector<std::vector<int64_t>>& per_seq) {
  Problem p = rp.problem();
  const int64_t C = static_cast<int64_t>(per_seq[0].size());
  CheckpointRun r;
  for (const auto& row : per_seq) r.offsets.insert(r.offsets.end(), row.begin(), row.end());
  r.states.assign(static_cast<size_t>(p.N * C * p.H * p.V * p.K), -7.0f);  // poison
  p.checkpoint_offsets = r.offsets.data();
  p.checkpoint_offsets_dtype = DType::kI64;
  p.checkpoint_state = r.states.data();
  p.checkpoints = C;
  testing::run_forward(testing::to_forward_args(p));
  return r;
}

void expect_checkpoints_match_prefixes(DType init_dtype, uint64_t seed) {
  ProblemSpec spec;
  spec.H = 2;
  spec.seqlens = {37, 64, 0, 20};
  spec.init = InitState::kNormal;
  spec.init_dtype = spec.final_dtype = init_dtype;
  spec.seed = seed;
  RandomProblem rp(spec);
  // Offset 0 (the initial state), chunk boundaries, a sequence's whole length, repeated offsets,
  // an empty sequence, unused (-1) entries anywhere.
  const std::vector<std::vector<int64_t>> valid = {{0, 16, 32, -1}, {16, 48, 64, 64}, {0, -1, -1, -1}, {-1, 0, 16, -1}};
  const CheckpointRun run = run_with_checkpoints(rp, valid);
  const Problem& p = rp.problem();
  const int64_t C = 4, per_state = p.H * p.V * p.K;
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t t = valid[n][c];
      const float* got = run.states.data() + (n * C + c) * per_state;
      if (t < 0) {
        for (int64_t e = 0; e < per_state; ++e) ASSERT_EQ(got[e], -7.0f) << "unused entry [" << n << ", " << c << "] written";
        continue;
      }
      const std::vector<float> want = prefix_final_state(p, n, t);
      EXPECT_EQ(0, std::memcmp(got, want.data(), want.size() * sizeof(float)))
          << "checkpoint [" << n << ", " << c << "] at " << t << " tokens differs from a prefill of them";
    }
}

TEST(Checkpoints, EqualPrefixPrefillsBitForBit) {
  expect_checkpoints_match_prefixes(DType::kF32, 1);
  expect_checkpoints_match_prefixes(DType::kBF16, 2);
}

// Against the fp64 oracle on the prefix, and the K-major layout.
TEST(Checkpoints, WithinTheBarOfTheOracleInBothLayouts) {
  ProblemSpec spec;
  spec.H = 2;
  spec.seqlens = {64};
  spec.init = InitState::kNormal;
  spec.seed = 3;
  RandomProblem rp(spec);
  const Problem& base = rp.problem();
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    Problem p = base;
    std::vector<float> init_kv(rp.init_f32.size()), final_kv(rp.init_f32.size());
    if (layout == StateLayout::kKV) {  // the same initial state, K-major
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t v = 0; v < p.V; ++v)
          for (int64_t k = 0; k < p.K; ++k)
            init_kv[(h * p.K + k) * p.V + v] = rp.init_f32[(h * p.V + v) * p.K + k];
      p.initial_state = init_kv.data();
      p.final_state = final_kv.data();
      p.state_layout = layout;
    }
    const int64_t offsets[] = {32};
    std::vector<float> checkpoint(static_cast<size_t>(p.H * p.V * p.K));
    p.checkpoint_offsets = offsets, p.checkpoint_offsets_dtype = DType::kI64;
    p.checkpoint_state = checkpoint.data(), p.checkpoints = 1;
    ASSERT_NO_THROW(testing::run_forward(testing::to_forward_args(p)));

    Problem prefix = base;  // the oracle on the first 32 tokens
    const int64_t cu[] = {0, 32};
    prefix.T = prefix.total_tokens = 32, prefix.cu_seqlens = cu, prefix.cu_seqlens_dtype = DType::kI64;
    std::vector<double> ref_out(static_cast<size_t>(32 * p.H * p.V)), ref_state(checkpoint.size());
    oracle_forward(prefix, ref_out.data(), ref_state.data());
    std::vector<float> got = checkpoint;
    if (layout == StateLayout::kKV)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t v = 0; v < p.V; ++v)
          for (int64_t k = 0; k < p.K; ++k) got[(h * p.V + v) * p.K + k] = checkpoint[(h * p.K + k) * p.V + v];
    EXPECT_LE(rel_error(ref_state.data(), got.data(), got.size()), kBar) << (layout == StateLayout::kVK ? "VK" : "KV");
  }
}

// ---------------------------------------------------------------------------------------------

class CheckpointRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    ProblemSpec spec;
    spec.H = 1;
    spec.seqlens = {40, 16};
    spec.init = InitState::kNormal;
    spec.seed = 4;
    rp_ = std::make_unique<RandomProblem>(spec);
    p_ = rp_->problem();
    states_.assign(static_cast<size_t>(2 * 2 * p_.H * p_.V * p_.K), 0.0f);
    p_.checkpoint_offsets = offsets_.data(), p_.checkpoint_offsets_dtype = DType::kI64;
    p_.checkpoint_state = states_.data(), p_.checkpoints = 2;
  }
  void expect_refused(const std::vector<std::string>& what) {
    const std::string message = testing::refusal_message(testing::to_forward_args(p_));
    for (const std::string& w : what) EXPECT_THAT(message, HasSubstr(w));
    for (float x : states_) ASSERT_EQ(x, 0.0f) << "a checkpoint was written";
  }
  std::unique_ptr<RandomProblem> rp_;
  Problem p_;
  std::vector<int64_t> offsets_ = {16, 32, 0, 16};
  std::vector<float> states_;
};

TEST_F(CheckpointRefusals, ValidOffsetsRun) { EXPECT_NO_THROW(testing::run_forward(testing::to_forward_args(p_))); }

TEST_F(CheckpointRefusals, NotAMultipleOf16) {
  offsets_[1] = 24;
  expect_refused({"checkpoint_offsets:", "checkpoint_offsets[0, 1] = 24", "not a multiple of 16"});
}

TEST_F(CheckpointRefusals, PastTheSequence) {
  offsets_[3] = 32;
  expect_refused({"checkpoint_offsets[1, 1] = 32", "past the end of sequence 1 (16 tokens)"});
}

TEST_F(CheckpointRefusals, Decreasing) {
  offsets_ = {32, 16, 0, 16};
  expect_refused({"offsets of sequence 0 decrease", "[0, 1] = 16 after [0, 0] = 32"});
}

TEST_F(CheckpointRefusals, StatesWithoutOffsets) {
  p_.checkpoint_offsets = nullptr;
  expect_refused({"checkpoint_state: given without checkpoint_offsets"});
}

TEST_F(CheckpointRefusals, StatesOfTheWrongShape) {
  ForwardArgs a = testing::to_forward_args(p_);
  a.checkpoint_state.shape[1] = 3;
  EXPECT_THAT(testing::refusal_message(a),
              HasSubstr("checkpoint_state: expected shape [2, 2, 1, 128, 128] [N, C, H, V, K]"));
}

}  // namespace
}  // namespace flashkda
