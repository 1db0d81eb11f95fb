// Strided q, k, v, g and beta on the CPU backend, through the public API: slices of one fused
// projection buffer give bit for bit the result of contiguous copies; what cannot be strided, or
// is strided wrongly, is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/random_problem.h"
#include "common/run_forward.h"

namespace flashkda {
namespace {

using testing::InitState;
using testing::ProblemSpec;
using testing::RandomProblem;
using ::testing::HasSubstr;

constexpr int64_t kD = 128;

// A fused projection [B, T, H, W] holding q, k, g, v side by side in each row (plus padding
// columns), and beta inside a [B, T, H, 3] buffer (column 1): the strided views of a random
// problem's inputs.
struct Fused {
  int64_t B, T, H, W = 4 * kD + 8;
  std::vector<uint16_t> proj, beta3;

  explicit Fused(const RandomProblem& rp) : B(rp.problem().B), T(rp.problem().T), H(rp.problem().H) {
    const Problem& p = rp.problem();
    proj.assign(static_cast<size_t>(B * T * H * W), float_to_bf16(99.0f));
    beta3.assign(static_cast<size_t>(B * T * H * 3), float_to_bf16(-99.0f));
    for (int64_t row = 0; row < B * T; ++row)
      for (int64_t h = 0; h < H; ++h) {
        uint16_t* dst = proj.data() + (row * H + h) * W;
        const int64_t src = (row * H + h) * kD;
        std::memcpy(dst + 0 * kD, p.q + src, kD * 2);
        std::memcpy(dst + 1 * kD, p.k + src, kD * 2);
        std::memcpy(dst + 2 * kD, p.g + src, kD * 2);
        std::memcpy(dst + 3 * kD, p.v + src, kD * 2);
        beta3[(row * H + h) * 3 + 1] = p.beta[row * H + h];
      }
  }
  Tensor view(int column) const {
    const int64_t shape[] = {B, T, H, kD}, strides[] = {T * H * W, H * W, W, 1};
    return make_strided_tensor(proj.data() + column * kD, DType::kBF16, 4, shape, strides);
  }
  Tensor beta_view() const {
    const int64_t shape[] = {B, T, H}, strides[] = {T * H * 3, H * 3, 3};
    return make_strided_tensor(beta3.data() + 1, DType::kBF16, 3, shape, strides);
  }
};

// Runs forward on the contiguous inputs and on the strided views; both outputs and final states.
void expect_strided_equals_contiguous(const ProblemSpec& spec) {
  SCOPED_TRACE(spec.describe());
  RandomProblem rp(spec);
  const Problem& p = rp.problem();
  const ForwardArgs contiguous = testing::to_forward_args(p);
  ASSERT_NO_THROW(testing::run_forward(contiguous));
  const std::vector<uint16_t> want_out(rp.out(), rp.out() + rp.out_size());
  const std::vector<float> want_state = rp.final_f32;

  Fused fused(rp);
  ForwardArgs strided = contiguous;
  strided.q = fused.view(0), strided.k = fused.view(1), strided.g = fused.view(2), strided.v = fused.view(3);
  strided.beta = fused.beta_view();
  std::vector<uint16_t> out(rp.out_size(), 0xABCD);
  std::vector<float> state(want_state.size(), -1.0f);
  strided.out.data = out.data();
  strided.final_state.data = state.data();
  ASSERT_NO_THROW(testing::run_forward(strided));
  EXPECT_TRUE(out == want_out) << "out differs from the contiguous run";
  EXPECT_TRUE(state == want_state) << "final_state differs from the contiguous run";
}

TEST(StridedInputs, FusedProjectionSlicesPacked) {
  ProblemSpec s;
  s.H = 2;
  s.seqlens = {37, 0, 16, 50};
  s.init = InitState::kNormal;
  s.seed = 5;
  expect_strided_equals_contiguous(s);
}

TEST(StridedInputs, FusedProjectionSlicesFixedBatch) {
  ProblemSpec s;
  s.H = 3;
  s.B = 2;
  s.T = 33;
  s.init = InitState::kNormal;
  s.seed = 6;
  expect_strided_equals_contiguous(s);
}

// Everything at once: strided inputs, a K-major pool in place at shuffled slots with a padding
// sequence, and checkpoints; bit for bit the same call on contiguous inputs.
TEST(StridedInputs, WithPoolsAndCheckpoints) {
  ProblemSpec s;
  s.H = 2;
  s.seqlens = {40, 16, 25};
  s.init = InitState::kNormal;
  s.seed = 9;
  RandomProblem rp(s);
  const Problem& base = rp.problem();
  const int64_t N = base.N, H = base.H, slots = 5, per_state = H * kD * kD;
  const std::vector<int64_t> slot = {3, -1, 0};  // sequence 1 is padding
  std::vector<float> pool(static_cast<size_t>(slots * per_state), 0.25f);
  for (int64_t n = 0; n < N; ++n)
    if (slot[n] >= 0)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t v = 0; v < kD; ++v)
          for (int64_t k = 0; k < kD; ++k)  // K-major: [slot, h, k, v]
            pool[static_cast<size_t>(((slot[n] * H + h) * kD + k) * kD + v)] =
                rp.init_f32[static_cast<size_t>(((n * H + h) * kD + v) * kD + k)];
  const std::vector<int64_t> offsets = {16, 32, -1, 16, 0, -1};  // [N, 2]
  auto run = [&](bool strided, std::vector<uint16_t>& out, std::vector<float>& pool_copy, std::vector<float>& ckpt) {
    Problem p = base;
    out.assign(rp.out_size(), 0xABCD);
    pool_copy = pool;
    ckpt.assign(static_cast<size_t>(N * 2 * per_state), -3.0f);
    p.out = out.data();
    p.state_layout = StateLayout::kKV;
    p.initial_state = p.final_state = pool_copy.data();
    p.initial_slots = p.final_slots = slots;
    p.state_indices = slot.data();
    p.checkpoint_offsets = offsets.data(), p.checkpoint_state = ckpt.data(), p.checkpoints = 2;
    ForwardArgs a = testing::to_forward_args(p);
    Fused fused(rp);
    if (strided) {
      a.q = fused.view(0), a.k = fused.view(1), a.g = fused.view(2), a.v = fused.view(3);
      a.beta = fused.beta_view();
    }
    testing::run_forward(a);
  };
  std::vector<uint16_t> out_c, out_s;
  std::vector<float> pool_c, pool_s, ckpt_c, ckpt_s;
  ASSERT_NO_THROW(run(false, out_c, pool_c, ckpt_c));
  ASSERT_NO_THROW(run(true, out_s, pool_s, ckpt_s));
  EXPECT_TRUE(out_s == out_c) << "out";
  EXPECT_TRUE(pool_s == pool_c) << "pool";
  EXPECT_TRUE(ckpt_s == ckpt_c) << "checkpoints";
  EXPECT_FALSE(pool_c == pool) << "the pool was updated";
  const std::vector<int64_t> seq = host_sequence_offsets(base);
  for (int64_t i = seq[1] * H * kD; i < seq[2] * H * kD; ++i) ASSERT_EQ(out_c[i], 0xABCD) << "padding wrote out";
  for (int64_t i = 2 * per_state; i < 4 * per_state; ++i) ASSERT_EQ(ckpt_c[i], -3.0f) << "padding wrote a checkpoint";
}

// A tensor without elements has no layout: frameworks give such tensors arbitrary strides, and an
// output or a state among them is still "dense".
TEST(StridedInputs, EmptyTensorsWithAnyStridesAreDense) {
  ProblemSpec s;
  s.H = 2;
  s.B = 2;
  s.T = 0;
  s.init = InitState::kNormal;
  s.seed = 8;
  RandomProblem rp(s);
  ForwardArgs a = testing::to_forward_args(rp.problem());
  const int64_t strides[] = {256, 256, 128, 1};
  for (int i = 0; i < 4; ++i) a.out.strides[i] = strides[i];
  EXPECT_NO_THROW(testing::run_forward(a));
  EXPECT_TRUE(rp.final_f32 == rp.init_f32) << "no tokens: the final state is the initial one";
}

// ---------------------------------------------------------------------------------------------

class StridedRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    ProblemSpec s;
    s.H = 2;
    s.seqlens = {20, 12};
    s.init = InitState::kNormal;
    s.seed = 7;
    rp_ = std::make_unique<RandomProblem>(s);
    fused_ = std::make_unique<Fused>(*rp_);
    a_ = testing::to_forward_args(rp_->problem());
    a_.q = fused_->view(0);
  }
  void expect_refused(const std::vector<std::string>& what) {
    const std::string message = testing::refusal_message(a_);
    for (const std::string& w : what) EXPECT_THAT(message, HasSubstr(w));
  }
  std::unique_ptr<RandomProblem> rp_;
  std::unique_ptr<Fused> fused_;
  ForwardArgs a_;
};

TEST_F(StridedRefusals, AStridedQRuns) { EXPECT_NO_THROW(testing::run_forward(a_)); }

TEST_F(StridedRefusals, OutMustBeDense) {
  const int64_t shape[] = {1, 32, 2, kD}, strides[] = {32 * 2 * 256, 2 * 256, 256, 1};
  std::vector<uint16_t> wide(static_cast<size_t>(32 * 2 * 256));
  a_.out = make_strided_tensor(wide.data(), DType::kBF16, 4, shape, strides);
  expect_refused({"out: expected a dense (contiguous, row-major) tensor", "only q, k, v, g and beta"});
}

TEST_F(StridedRefusals, LastDimensionMustBeContiguous) {
  Tensor& q = a_.q;
  q.strides[3] = 2;
  expect_refused({"q: expected the last dimension contiguous (stride 1)", "got strides [", ", 2]"});
}

TEST_F(StridedRefusals, NegativeStrides) {
  a_.k = fused_->view(1);
  a_.k.strides[2] = -static_cast<int64_t>(fused_->W);
  expect_refused({"k: negative strides are not supported"});
}

TEST_F(StridedRefusals, OutInsideTheFusedBufferOverlaps) {
  a_.out.data = fused_->proj.data() + 2 * kD;  // within the span of the strided q
  expect_refused({"out: overlaps q"});
}

}  // namespace
}  // namespace flashkda
