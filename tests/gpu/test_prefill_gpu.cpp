// The CUDA prefill path against the fp64 oracle (issue 3's test matrix). Every run poisons the
// outputs first (NaN), checks that every element was written, that the guard bytes behind each
// output are untouched, that two runs are bit-identical, and that rel error <= 3e-3
// (docs/contract.md).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "cpu/oracle.h"
#include "device_problem.h"
#include "gpu/gpu_backend.h"

namespace flashkda::testing {
namespace {

class GpuPrefill : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0 || !cuda_compiled())
      GTEST_SKIP() << "no CUDA device (or built without CUDA): GPU prefill tests skipped";
  }
};

ProblemSpec packed(std::vector<int64_t> lens, int64_t heads, uint64_t seed) {
  ProblemSpec s;
  s.seqlens = std::move(lens);
  s.H = heads;
  s.seed = seed;
  s.init = InitState::kNormal;
  s.init_dtype = DType::kBF16;
  s.final_state = true;
  s.final_dtype = DType::kBF16;
  return s;
}

// Expects a fresh call (outputs poisoned first) to write what `base` holds, bit for bit; `what`
// names the call in the failure.
void expect_same_outputs(DeviceProblem& dev, const DeviceProblem::Outputs& base, const std::string& what) {
  const DeviceProblem::Outputs got = dev.run_fresh();
  EXPECT_TRUE(got.out == base.out) << what << ": out differs";
  EXPECT_TRUE(got.final_state == base.final_state) << what << ": final state differs";
}

// A state-pass form a test forces through a launcher switch, and the packed problem it runs.
struct SwitchForm {
  const char* variable;  // the switch (FLASHKDA_*), or nullptr for the launcher's own choice
  const char* value;
  std::vector<int64_t> lens;
  int64_t heads = 3;
};

void expect_matches_oracle(RandomProblem& host) {
  const ProblemSpec& spec = host.spec();
  SCOPED_TRACE(spec.describe());
  DeviceProblem dev(host);

  const DeviceProblem::Outputs first = dev.run_fresh();
  const std::vector<uint16_t>& out = first.out;
  const std::vector<uint8_t>& state = first.final_state;
  EXPECT_TRUE(dev.guards_intact()) << "bytes behind out or final_state were written";
  expect_same_outputs(dev, first, "a second run");

  const Problem& p = host.problem();
  std::vector<double> ref_out(host.out_size());
  std::vector<double> ref_state(p.final_state ? host.state_size() : 0);
  oracle_forward(p, ref_out.data(), p.final_state ? ref_state.data() : nullptr);

  EXPECT_TRUE(all_finite(out.data(), out.size())) << "out holds NaN/Inf or unwritten (poisoned) elements";
  const double e_out = rel_error(ref_out.data(), out.data(), out.size());
  EXPECT_LE(e_out, kBar) << "out";
  double e_state = 0.0;
  if (p.final_state) {
    EXPECT_TRUE(all_finite(state.data(), p.final_state_dtype, ref_state.size()))
        << "final_state holds NaN/Inf or unwritten (poisoned) elements";
    e_state = rel_error(ref_state.data(), state.data(), p.final_state_dtype, ref_state.size());
    EXPECT_LE(e_state, kBar) << "final_state";
  }
  std::printf("  [gpu vs oracle] %-70s out %.2e  state %.2e\n", spec.describe().c_str(), e_out, e_state);
}

void expect_matches_oracle(const ProblemSpec& spec) {
  RandomProblem host(spec);
  expect_matches_oracle(host);
}

// Lengths 0, 1, 15, 16, 17, 33, 1000, 4097, 8192 as single sequences.
class GpuPrefillLength : public GpuPrefill, public ::testing::WithParamInterface<int64_t> {};

TEST_P(GpuPrefillLength, MatchesOracle) {
  const int64_t len = GetParam();
  expect_matches_oracle(packed({len}, len > 2000 ? 2 : 4, 100 + len));
}

INSTANTIATE_TEST_SUITE_P(Lengths, GpuPrefillLength, ::testing::Values(0, 1, 15, 16, 17, 33, 1000, 4097, 8192));

class GpuPrefillHeads : public GpuPrefill, public ::testing::WithParamInterface<int64_t> {};

TEST_P(GpuPrefillHeads, MatchesOracle) { expect_matches_oracle(packed({40, 100, 17}, GetParam(), 7)); }

INSTANTIATE_TEST_SUITE_P(Heads, GpuPrefillHeads, ::testing::Values(1, 4, 32, 96));

TEST_F(GpuPrefill, FixedLengthBatch) {
  ProblemSpec s = packed({}, 4, 11);
  s.B = 3;
  s.T = 77;
  expect_matches_oracle(s);
}

TEST_F(GpuPrefill, ManyShortSequencesPacked) {
  std::mt19937_64 rng(5);
  std::vector<int64_t> lens(64);
  for (auto& l : lens) l = static_cast<int64_t>(rng() % 41);  // 0..40 tokens, zeros included
  expect_matches_oracle(packed(lens, 4, 12));
}

TEST_F(GpuPrefill, MixedLongSequences) { expect_matches_oracle(packed({1300, 547, 2048, 963, 271, 3063}, 2, 13)); }

TEST_F(GpuPrefill, Int32CuSeqlens) {
  ProblemSpec s = packed({5, 0, 33, 18}, 4, 14);
  s.cu_seqlens_dtype = DType::kI32;
  expect_matches_oracle(s);
}

// Initial state none / bf16 / f32, final state none / given, in every allowed combination.
TEST_F(GpuPrefill, StateCombinations) {
  for (InitState init : {InitState::kNone, InitState::kNormal})
    for (DType dtype : {DType::kBF16, DType::kF32})
      for (bool final_state : {false, true}) {
        if (init == InitState::kNone && dtype == DType::kBF16 && !final_state) continue;  // same as f32 case
        ProblemSpec s = packed({37, 16, 1, 70}, 4, 15);
        s.init = init;
        s.init_dtype = s.final_dtype = dtype;
        s.final_state = final_state;
        expect_matches_oracle(s);
      }
}

TEST_F(GpuPrefill, GateSweepConstant) {
  for (float gc : {-8.0f, -4.0f, 0.0f, 4.0f, 8.0f}) {
    ProblemSpec s = packed({300, 45}, 2, 16);
    s.g_input = GateInput::kConstant;
    s.g_const = gc;
    expect_matches_oracle(s);
  }
}

TEST_F(GpuPrefill, GateSweepUniformAndWideBias) {
  ProblemSpec s = packed({300, 45}, 2, 17);
  s.g_input = GateInput::kUniform8;
  expect_matches_oracle(s);
  s.dt_bias_input = DtBiasInput::kWide;
  expect_matches_oracle(s);
  s.g_input = GateInput::kNormal;
  expect_matches_oracle(s);
}

TEST_F(GpuPrefill, LowerBoundSweep) {
  for (float lb : {-5.0f, -1.0f, -0.1f}) {
    ProblemSpec s = packed({200}, 2, 18);
    s.lower_bound = lb;
    expect_matches_oracle(s);
  }
}

TEST_F(GpuPrefill, LargeInitialState) {
  for (DType dtype : {DType::kBF16, DType::kF32})
    for (float gc : {-8.0f, 0.0f}) {
      ProblemSpec s = packed({1000}, 2, 19);
      s.init = InitState::kLarge;
      s.init_dtype = s.final_dtype = dtype;
      s.g_input = GateInput::kConstant;
      s.g_const = gc;
      expect_matches_oracle(s);
    }
}

// Every state-pass layout (the launcher picks one by problem size; the variable forces it).
class GpuPrefillLayout : public GpuPrefill, public ::testing::WithParamInterface<const char*> {
 protected:
  void TearDown() override { unsetenv("FLASHKDA_STATE_CONFIG"); }
};

TEST_P(GpuPrefillLayout, MatchesOracle) {
  setenv("FLASHKDA_STATE_CONFIG", GetParam(), 1);
  expect_matches_oracle(packed({300, 0, 17, 1, 64}, 3, 26));
  ProblemSpec large = packed({700}, 2, 27);
  large.init = InitState::kLarge;
  large.init_dtype = large.final_dtype = DType::kF32;
  large.g_input = GateInput::kConstant;
  large.g_const = -8.0f;
  expect_matches_oracle(large);
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuPrefillLayout, ::testing::Values("8x1", "4x1", "2x2", "1x4"));

// A suite that forces one launcher path of the chunked prefill on (its variable set to 1) for
// each of its tests, on the chunked kernels even where a call is decode-shaped.
class GpuPrefillForced : public GpuPrefill {
 protected:
  explicit GpuPrefillForced(const char* variable) : variable_(variable) {}
  void SetUp() override {
    GpuPrefill::SetUp();
    setenv(variable_, "1", 1);
    setenv("FLASHKDA_CUDA_KERNELS", "chunked", 1);
  }
  void TearDown() override {
    unsetenv(variable_);
    unsetenv("FLASHKDA_CUDA_KERNELS");
  }

 private:
  const char* variable_;
};

// The segment-parallel state pass (one sequence split at its middle chunk, three runs stitched):
// the launcher takes it for a long sequence on few heads; FLASHKDA_SPLIT=1 forces it here.
class GpuPrefillSplit : public GpuPrefillForced, public ::testing::WithParamInterface<int64_t> {
 protected:
  GpuPrefillSplit() : GpuPrefillForced("FLASHKDA_SPLIT") {}
};

TEST_P(GpuPrefillSplit, MatchesOracle) {
  const int64_t len = GetParam();
  expect_matches_oracle(packed({len}, 3, 300 + static_cast<uint64_t>(len)));
  for (const DType dtype : {DType::kBF16, DType::kF32}) {  // fixed-length form, fp32 and no states
    ProblemSpec s;
    s.T = len;
    s.H = 2;
    s.seed = 400 + static_cast<uint64_t>(len);
    s.init = dtype == DType::kF32 ? InitState::kNormal : InitState::kNone;
    s.init_dtype = s.final_dtype = dtype;
    s.final_state = dtype == DType::kF32;
    expect_matches_oracle(s);
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, GpuPrefillSplit, ::testing::Values(0, 1, 16, 17, 33, 1000, 4097));

// More segments: S = 3 and 16 on the wgmma pass the launcher takes (a block a head and run);
// S = 3 (one block a multiprocessor for these heads), 4 and 7 (3-stage blocks, two a
// multiprocessor) on the 2x2 layout, and S = 4 on 1x4; segments past the sequence's chunks are
// empty (A = I, B = 0).
class GpuPrefillSplitSegments : public GpuPrefill,
                                public ::testing::WithParamInterface<std::pair<const char*, const char*>> {
 protected:
  void SetUp() override {
    GpuPrefill::SetUp();
    setenv("FLASHKDA_SPLIT_LAYOUT", GetParam().first, 1);
    setenv("FLASHKDA_SPLIT_SEGMENTS", GetParam().second, 1);
    setenv("FLASHKDA_SPLIT_FUSED", "0", 1);  // the state pass's runs (the fused ones: GpuPrefillSplitFused)
  }
  void TearDown() override {
    unsetenv("FLASHKDA_SPLIT_LAYOUT");
    unsetenv("FLASHKDA_SPLIT_SEGMENTS");
    unsetenv("FLASHKDA_SPLIT_FUSED");
  }
};

// Lengths 0 to 4097 (segments past the sequence's chunks are empty: A = I, B = 0), fp32 states, a
// large state with little decay, and the chain without a final state. `extra`: more lengths.
void expect_split_segments_match_oracle(std::vector<int64_t> extra = {}) {
  std::vector<int64_t> lens = {0, 1, 17, 100, 1000, 4097};
  lens.insert(lens.end(), extra.begin(), extra.end());
  for (const int64_t len : lens) {
    expect_matches_oracle(packed({len}, 3, 700 + static_cast<uint64_t>(len)));
    ProblemSpec s;  // fixed-length form, fp32 states
    s.T = len;
    s.H = 2;
    s.seed = 800 + static_cast<uint64_t>(len);
    s.init = InitState::kNormal;
    s.init_dtype = s.final_dtype = DType::kF32;
    expect_matches_oracle(s);
  }
  ProblemSpec large = packed({2000}, 2, 900);  // large state, little decay
  large.init = InitState::kLarge;
  large.g_input = GateInput::kConstant;
  large.g_const = -8.0f;
  expect_matches_oracle(large);
  ProblemSpec no_final = packed({700}, 2, 901);  // the chain of segment states without a final state
  no_final.final_state = false;
  expect_matches_oracle(no_final);
}

TEST_P(GpuPrefillSplitSegments, MatchesOracle) { expect_split_segments_match_oracle(); }

INSTANTIATE_TEST_SUITE_P(Segments, GpuPrefillSplitSegments,
                         ::testing::Values(std::make_pair("wgmma", "3"), std::make_pair("wgmma", "16"),
                                           std::make_pair("2x2", "3"), std::make_pair("2x2", "4"),
                                           std::make_pair("2x2", "7"), std::make_pair("1x4", "4")));

// The split pass's runs on the fused prefill (FLASHKDA_SPLIT_FUSED=1: chunks of 64 tokens, each run
// preparing its own) at S = 3, 8 and 16, with lengths around its chunk too.
class GpuPrefillSplitFused : public GpuPrefill, public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    GpuPrefill::SetUp();
    setenv("FLASHKDA_SPLIT_FUSED", "1", 1);
    setenv("FLASHKDA_SPLIT_SEGMENTS", GetParam(), 1);
  }
  void TearDown() override {
    unsetenv("FLASHKDA_SPLIT_FUSED");
    unsetenv("FLASHKDA_SPLIT_SEGMENTS");
  }
};

TEST_P(GpuPrefillSplitFused, MatchesOracle) { expect_split_segments_match_oracle({63, 64, 65, 200, 1100}); }

INSTANTIATE_TEST_SUITE_P(Segments, GpuPrefillSplitFused, ::testing::Values("3", "8", "16"));

// A segment's two fused runs as one cluster that prepares each chunk once (FLASHKDA_SPLIT_SHARED=1:
// each block prepares every other chunk and hands the other its operands): the same cases, and bit
// for bit the runs that prepare their own (the same operations on the same operands).
class GpuPrefillSplitShared : public GpuPrefillSplitFused {
 protected:
  void SetUp() override {
    GpuPrefillSplitFused::SetUp();
    setenv("FLASHKDA_SPLIT_SHARED", "1", 1);
  }
  void TearDown() override {
    unsetenv("FLASHKDA_SPLIT_SHARED");
    GpuPrefillSplitFused::TearDown();
  }
};

TEST_P(GpuPrefillSplitShared, MatchesOracle) { expect_split_segments_match_oracle({63, 64, 65, 200, 1100}); }

TEST_P(GpuPrefillSplitShared, BitForBitTheRunsAlone) {
  for (const int64_t len : {1, 64, 129, 1100, 4097}) {
    ProblemSpec spec = packed({len}, 3, 1300 + static_cast<uint64_t>(len));
    spec.init_dtype = spec.final_dtype = DType::kF32;
    RandomProblem host(spec);
    DeviceProblem dev(host);
    setenv("FLASHKDA_SPLIT_SHARED", "0", 1);
    const DeviceProblem::Outputs base = dev.run_fresh();
    setenv("FLASHKDA_SPLIT_SHARED", "1", 1);
    for (int run = 0; run < 2; ++run) expect_same_outputs(dev, base, "T = " + std::to_string(len) + ", run " + std::to_string(run));
  }
}

INSTANTIATE_TEST_SUITE_P(Segments, GpuPrefillSplitShared, ::testing::Values("3", "8", "16"));

TEST_F(GpuPrefill, SplitLargeStateLittleDecay) {
  setenv("FLASHKDA_SPLIT", "1", 1);
  for (const float gc : {-8.0f, 0.0f}) {
    ProblemSpec s = packed({1000}, 2, 301);
    s.init = InitState::kLarge;
    s.init_dtype = s.final_dtype = DType::kBF16;
    s.g_input = GateInput::kConstant;
    s.g_const = gc;
    expect_matches_oracle(s);
  }
  unsetenv("FLASHKDA_SPLIT");
}

// The persistent state pass (a block per multiprocessor taking (sequence, head) items from a
// counter, each item's initial state staged in shared memory): the launcher takes it for at
// least twice as many items as multiprocessors; FLASHKDA_PERSISTENT=1 forces it here.
class GpuPrefillPersistent : public GpuPrefillForced {
 protected:
  GpuPrefillPersistent() : GpuPrefillForced("FLASHKDA_PERSISTENT") {}
};

// Edge lengths (empty, single-token, around the chunk size) with every form of the states:
// bf16, fp32 with int32 cu_seqlens, no initial state (sequences start from zero), initial state
// only. Seeds seed .. seed + 3.
void expect_edge_lengths_every_state_form(uint64_t seed) {
  const std::vector<int64_t> lens = {20, 0, 1, 15, 16, 17, 33, 128};
  expect_matches_oracle(packed(lens, 3, seed));
  ProblemSpec f32 = packed(lens, 3, seed + 1);
  f32.init_dtype = f32.final_dtype = DType::kF32;
  f32.cu_seqlens_dtype = DType::kI32;
  expect_matches_oracle(f32);
  ProblemSpec no_init = packed(lens, 3, seed + 2);
  no_init.init = InitState::kNone;
  expect_matches_oracle(no_init);
  ProblemSpec no_final = packed(lens, 3, seed + 3);
  no_final.final_state = false;
  expect_matches_oracle(no_final);
}

TEST_F(GpuPrefillPersistent, EdgeLengthsEveryStateForm) { expect_edge_lengths_every_state_form(500); }

// More items than blocks: every block runs several items through one pipeline and one staged
// state buffer (the phase bookkeeping across items), fixed-length and packed.
TEST_F(GpuPrefillPersistent, ManyItemsPerBlock) {
  std::mt19937_64 rng(504);
  std::vector<int64_t> lens(300);
  for (int64_t& len : lens) len = static_cast<int64_t>(rng() % 49);  // 0..48 tokens
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    ProblemSpec s = packed(lens, 4, dtype == DType::kF32 ? 505 : 506);
    s.init_dtype = s.final_dtype = dtype;
    expect_matches_oracle(s);
  }
  ProblemSpec fixed;  // B = 64 rows of 128 tokens (P9's shape on 8 heads)
  fixed.B = 64;
  fixed.T = 128;
  fixed.H = 8;
  fixed.seed = 507;
  fixed.init = InitState::kNormal;
  fixed.init_dtype = fixed.final_dtype = DType::kBF16;
  expect_matches_oracle(fixed);
}

// About three items a block (400 on the H200's 132 multiprocessors), small enough for the
// sanitizers.
TEST_F(GpuPrefillPersistent, ManyTinyItems) {
  std::mt19937_64 rng(509);
  std::vector<int64_t> lens(400);
  for (int64_t& len : lens) len = static_cast<int64_t>(rng() % 6);  // 0..5 tokens
  expect_matches_oracle(packed(lens, 1, 509));
}

// Items are taken longest sequence first up to kMaxOrderedSeqs sequences (the prep kernel ranks
// them), in index order beyond: both sides of the bound, lengths from 0 to 70 tokens.
TEST_F(GpuPrefillPersistent, LongestFirstOrderAndBeyondItsBound) {
  constexpr int64_t kMaxOrdered = 512;  // kMaxOrderedSeqs of gpu/prefill/sequences.cuh (device code)
  for (const int64_t n : {int64_t{2}, kMaxOrdered, kMaxOrdered + 1}) {
    std::mt19937_64 rng(510 + n);
    std::vector<int64_t> lens(n);
    for (int64_t& len : lens) len = static_cast<int64_t>(rng() % 71);
    expect_matches_oracle(packed(lens, 1, 510 + n));
  }
}

TEST_F(GpuPrefillPersistent, LargeInitialStateLittleDecay) {
  for (const DType dtype : {DType::kBF16, DType::kF32})
    for (const float gc : {-8.0f, 0.0f}) {
      ProblemSpec s = packed({100, 37, 0, 250}, 2, 508);
      s.init = InitState::kLarge;
      s.init_dtype = s.final_dtype = dtype;
      s.g_input = GateInput::kConstant;
      s.g_const = gc;
      expect_matches_oracle(s);
    }
}

// The experimental wgmma state pass (state_wgmma_kernel.cu), forced by FLASHKDA_STATE_WGMMA=1:
// per item, V-major states, no checkpoints (those calls keep the mma.sync passes).
RandomProblem& kimi_softplus(RandomProblem& host, uint64_t seed);  // below, with the softplus tests

class GpuPrefillWgmma : public GpuPrefillForced {
 protected:
  GpuPrefillWgmma() : GpuPrefillForced("FLASHKDA_STATE_WGMMA") {}
};

TEST_F(GpuPrefillWgmma, EdgeLengthsEveryStateForm) { expect_edge_lengths_every_state_form(600); }

TEST_F(GpuPrefillWgmma, LongSequencesLargeStatesAndTheSoftplusGate) {
  expect_matches_oracle(packed({1000, 4097}, 2, 604));
  ProblemSpec large = packed({700}, 2, 605);  // a large fp32 state that little decay keeps
  large.init = InitState::kLarge;
  large.init_dtype = large.final_dtype = DType::kF32;
  large.g_input = GateInput::kConstant;
  large.g_const = -8.0f;
  expect_matches_oracle(large);
  ProblemSpec spec = packed({300, 0, 17, 1, 64}, 3, 606);
  spec.gate = Gate::kSoftplus;
  RandomProblem host(spec);
  expect_matches_oracle(kimi_softplus(host, 607));
}

// The fp16 step (state_step_f16.cuh, F16Records), forced by FLASHKDA_STATE_F16=1 on the 8x1
// passes that take it: per item (FLASHKDA_STATE_CONFIG=8x1) and persistent (FLASHKDA_PERSISTENT=1).
// Every state row carries a power-of-two scale that a warp rescales where a row's bound or its
// update leaves [2^-6, 2^14]: the large states, |v| ~ 1e4 and |v| ~ 1e-4 cases take that branch
// from both sides (relative error is scale-free: the bar is the same).
void expect_prep_tail_bit_for_bit(int64_t tokens, int64_t heads, uint64_t seed, const char* forced_share);  // below

class GpuPrefillF16 : public GpuPrefillForced, public ::testing::WithParamInterface<const char*> {
 protected:
  GpuPrefillF16() : GpuPrefillForced("FLASHKDA_STATE_F16") {}
  bool persistent() const { return std::string(GetParam()) == "persistent"; }
  void SetUp() override {
    GpuPrefillForced::SetUp();
    if (persistent()) setenv("FLASHKDA_PERSISTENT", "1", 1);
    else setenv("FLASHKDA_STATE_CONFIG", "8x1", 1);
  }
  void TearDown() override {
    unsetenv("FLASHKDA_PERSISTENT");
    unsetenv("FLASHKDA_STATE_CONFIG");
    GpuPrefillForced::TearDown();
  }
};

// v times a power of two (exact in bf16 while in range).
RandomProblem& scale_values(RandomProblem& host, float factor) {
  for (uint16_t& x : host.v) x = float_to_bf16(bf16_to_float(x) * factor);
  return host;
}

TEST_P(GpuPrefillF16, EdgeLengthsEveryStateForm) { expect_edge_lengths_every_state_form(620); }

// Large fp32 and bf16 states (|S0| ~ 1e3) under a constant gate input each: -8 keeps them (little
// decay), 0 some, +8 decays them by ~e^-5 a token.
void expect_large_states(uint64_t seed, std::initializer_list<float> gates) {
  for (const DType dtype : {DType::kF32, DType::kBF16})
    for (const float gc : gates) {
      ProblemSpec large = packed({700, 33}, 2, seed);
      large.init = InitState::kLarge;
      large.init_dtype = large.final_dtype = dtype;
      large.g_input = GateInput::kConstant;
      large.g_const = gc;
      expect_matches_oracle(large);
    }
}

TEST_P(GpuPrefillF16, LongSequencesLargeStatesAndTheSoftplusGate) {
  expect_matches_oracle(packed({1000, 4097}, 2, 624));
  expect_large_states(625, {-8.0f, 0.0f});
  ProblemSpec spec = packed({300, 0, 17, 1, 64}, 3, 626);
  spec.gate = Gate::kSoftplus;
  RandomProblem host(spec);
  expect_matches_oracle(kimi_softplus(host, 627));
}

// v x 8192 and x 2^-14 (seeds seed, seed + 1), from no initial state and from a random one.
void expect_large_and_small_values(uint64_t seed) {
  for (const float factor : {8192.0f, 1.0f / 16384.0f}) {
    SCOPED_TRACE("v x " + std::to_string(factor));
    for (const InitState init : {InitState::kNone, InitState::kNormal}) {
      ProblemSpec spec = packed({1000, 17, 300}, 2, factor > 1.0f ? seed : seed + 1);
      spec.init = init;
      spec.init_dtype = spec.final_dtype = DType::kF32;
      RandomProblem host(spec);
      expect_matches_oracle(scale_values(host, factor));
    }
  }
}

TEST_P(GpuPrefillF16, LargeAndSmallValuesTakeTheRescale) { expect_large_and_small_values(628); }

// The prep tail (one sequence, the per-item 8x1 pass) writes F16Records as the prep grid does.
TEST_P(GpuPrefillF16, PrepTailMatchesOnePrepGridBitForBit) {
  if (persistent()) GTEST_SKIP() << "the prep tail runs beside the per-item pass only";
  expect_prep_tail_bit_for_bit(3000, 6, 630, "0.2");
}

INSTANTIATE_TEST_SUITE_P(Passes, GpuPrefillF16, ::testing::Values("per-item", "persistent"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "persistent" ? "Persistent" : "PerItem";
                         });

// The fused chunk-64 prefill (fused_kernel.cu), forced by FLASHKDA_FUSED=1: safe gate, V-major
// states without pools or checkpoints. Its chunk is 64 tokens, so the edge lengths are those
// around 64 too; its fp16 operands ride on a power-of-two scale per state row that covers the
// state and the chunk's v: large states, |v| ~ 1e4 and ~ 1e-4, strong and no decay.
ErrorCode run_expecting_error(DeviceProblem& dev, const ForwardArgs& a, std::string* message);  // below

class GpuPrefillFused : public GpuPrefillForced {
 protected:
  GpuPrefillFused() : GpuPrefillForced("FLASHKDA_FUSED") {}
  void SetUp() override {  // one block an item (forced, the plan takes pairs where they fit: GpuPrefillFusedPair)
    GpuPrefillForced::SetUp();
    setenv("FLASHKDA_FUSED_PAIR", "0", 1);
  }
  void TearDown() override {
    unsetenv("FLASHKDA_FUSED_PAIR");
    GpuPrefillForced::TearDown();
  }
};

// Long sequences and many heads for the fused prefill's forms: seeds seed .. seed + 2.
void expect_fused_long_sequences(uint64_t seed) {
  expect_matches_oracle(packed({1000, 4097}, 2, seed));
  expect_matches_oracle(packed({8192}, 2, seed + 1));
  expect_matches_oracle(packed({300, 40, 129}, 32, seed + 2));
}

TEST_F(GpuPrefillFused, EdgeLengthsEveryStateForm) {
  expect_edge_lengths_every_state_form(640);
  expect_matches_oracle(packed({63, 64, 65, 127, 128, 129, 191}, 3, 644));
}

TEST_F(GpuPrefillFused, LongSequencesManyHeads) { expect_fused_long_sequences(645); }

TEST_F(GpuPrefillFused, LargeStatesAndDecaySweep) { expect_large_states(648, {-8.0f, 0.0f, 8.0f}); }

TEST_F(GpuPrefillFused, LargeAndSmallValues) { expect_large_and_small_values(649); }

TEST_F(GpuPrefillFused, RefusesWhatItLacks) {
  ProblemSpec spec = packed({100}, 2, 651);
  spec.gate = Gate::kSoftplus;
  RandomProblem host(spec);
  DeviceProblem dev(host);
  std::string msg;
  EXPECT_EQ(run_expecting_error(dev, dev.args(), &msg), ErrorCode::kUnsupported);
  EXPECT_THAT(msg, ::testing::HasSubstr("FLASHKDA_FUSED=1: the fused prefill does not take the softplus gate"));
}

// Blocks take the sequences longest first when there are at most 64 (each block ranks them
// itself), in index order beyond: both sides of the bound, lengths from 0 to 200 tokens.
TEST_F(GpuPrefillFused, LongestFirstUpToItsBound) {
  constexpr int64_t kMaxRanked = 64;  // kMaxLongestFirstSeqs of gpu/prefill/fused_config.h (device code)
  for (const int64_t n : {kMaxRanked, kMaxRanked + 1}) {
    std::mt19937_64 rng(652 + n);
    std::vector<int64_t> lens(n);
    for (int64_t& len : lens) len = static_cast<int64_t>(rng() % 201);
    expect_matches_oracle(packed(lens, 2, 652 + n));
  }
}

// The fused prefill's pair form (FLASHKDA_FUSED_PAIR=1: two blocks of a cluster an item, each
// keeping its own copy of the state and applying the other's chunks with the owner's own operations
// and instruction): the same cases, and bit for bit the results of one block an item.
class GpuPrefillFusedPair : public GpuPrefillFused {
 protected:
  void SetUp() override {
    GpuPrefillFused::SetUp();
    setenv("FLASHKDA_FUSED_PAIR", "1", 1);
  }
  void TearDown() override {
    unsetenv("FLASHKDA_FUSED_PAIR_PREFETCH");
    GpuPrefillFused::TearDown();
  }
};

TEST_F(GpuPrefillFusedPair, EdgeLengthsEveryStateForm) {
  expect_edge_lengths_every_state_form(670);
  expect_matches_oracle(packed({63, 64, 65, 127, 128, 129, 191, 192, 193}, 3, 671));
}

TEST_F(GpuPrefillFusedPair, LongSequencesManyHeads) { expect_fused_long_sequences(672); }

TEST_F(GpuPrefillFusedPair, LargeStatesAndDecaySweep) { expect_large_states(675, {-8.0f, 0.0f, 8.0f}); }

TEST_F(GpuPrefillFusedPair, LargeAndSmallValues) { expect_large_and_small_values(676); }

// Lengths 0 to 400 (a block of a pair with no chunk, one, several: block 1 applying block 0's
// first chunk, block 0 its identity update), fp32 and bf16 states: every output of the pair form
// bit for bit the one-block form's, twice with and without the L2 prefetch.
TEST_F(GpuPrefillFusedPair, BitForBitOneBlockAnItem) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    ProblemSpec spec = packed({0, 1, 64, 65, 128, 129, 400, 333}, 3, 677);
    spec.init = InitState::kNormal;
    spec.init_dtype = spec.final_dtype = dtype;
    RandomProblem host(spec);
    DeviceProblem dev(host);
    setenv("FLASHKDA_FUSED_PAIR", "0", 1);
    const DeviceProblem::Outputs base = dev.run_fresh();
    setenv("FLASHKDA_FUSED_PAIR", "1", 1);
    for (const char* prefetch : {"1", "0"}) {
      setenv("FLASHKDA_FUSED_PAIR_PREFETCH", prefetch, 1);
      for (int run = 0; run < 2; ++run)
        expect_same_outputs(dev, base, std::string("FLASHKDA_FUSED_PAIR_PREFETCH=") + prefetch + ", run " + std::to_string(run));
    }
    expect_matches_oracle(host);
  }
}

// The plan's own choice, nothing forced: sequences of 1024 tokens or more on average on
// (sequence, head) items for 70% of the multiprocessors or more take the fused prefill
// (prefill_launch.cu, use_fused), longest first. The smallest such call on this device.
TEST_F(GpuPrefill, ManyLongSequencesTakeTheFusedPrefillByDefault) {
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  const int64_t heads = (70 * int64_t{sms} + 199) / 200;  // two sequences: 2 H >= 70% of the multiprocessors
  RandomProblem host(packed({1100, 1000}, heads, 656));
  const gpu::PrefillPlan plan = gpu::plan_prefill(host.problem());
  EXPECT_EQ(plan.pass, gpu::PrefillPlan::Pass::kFused);
  EXPECT_TRUE(plan.fused_longest_first);
  expect_matches_oracle(host);
}

// FLASHKDA_PREP_BLOCKS_PER_SM (an occupancy experiment) pads the prep kernel's shared memory:
// the records, and so every output, stay bit for bit those of the unpadded launch.
TEST_F(GpuPrefill, PrepOccupancyPaddingKeepsResultsBitForBit) {
  RandomProblem host(packed({300, 17, 64}, 3, 23));
  DeviceProblem dev(host);
  const DeviceProblem::Outputs base = dev.run_fresh();
  for (const char* n : {"1", "3"}) {
    setenv("FLASHKDA_PREP_BLOCKS_PER_SM", n, 1);
    expect_same_outputs(dev, base, std::string(n) + " blocks a multiprocessor");
  }
  unsetenv("FLASHKDA_PREP_BLOCKS_PER_SM");
}

// A call of one sequence of `tokens` on `heads` heads, both gates: its outputs with the launcher's
// prep tail and with `forced_share`, two runs each, bit for bit those of the prep kernel alone
// (FLASHKDA_PREP_TAIL=0), then against the oracle. The tail only moves where records are written.
void expect_prep_tail_bit_for_bit(int64_t tokens, int64_t heads, uint64_t seed, const char* forced_share) {
  for (const Gate gate : {Gate::kSafe, Gate::kSoftplus}) {
    SCOPED_TRACE(gate == Gate::kSoftplus ? "softplus gate" : "safe gate");
    ProblemSpec spec = packed({tokens}, heads, seed);
    spec.gate = gate;
    RandomProblem host(spec);
    if (gate == Gate::kSoftplus) kimi_softplus(host, seed + 1);
    DeviceProblem dev(host);
    setenv("FLASHKDA_PREP_TAIL", "0", 1);
    const DeviceProblem::Outputs base = dev.run_fresh();
    unsetenv("FLASHKDA_PREP_TAIL");
    for (const char* share : {"", forced_share}) {
      if (*share) setenv("FLASHKDA_PREP_TAIL_SHARE", share, 1);
      for (int run = 0; run < 2; ++run)
        expect_same_outputs(dev, base, "share '" + std::string(share) + "', run " + std::to_string(run));
      unsetenv("FLASHKDA_PREP_TAIL_SHARE");
    }
    expect_matches_oracle(host);
  }
}

// The prep tail (one sequence on the 8x1 layout: the last chunks' records by a second prep grid
// while the chains run, handed over by ready flags) gives the records, and so every output, of
// the prep kernel alone: bit for bit, at the launcher's share and at a forced one.
TEST_F(GpuPrefill, PrepTailMatchesOnePrepGridBitForBit) {
  setenv("FLASHKDA_STATE_CONFIG", "8x1", 1);
  expect_prep_tail_bit_for_bit(3000, 6, 33, "0.2");
  unsetenv("FLASHKDA_STATE_CONFIG");
}

// The same on the wgmma split pass (one sequence cut in segments, runs a block a head and run):
// the tail writes the last chunks of every segment on the multiprocessors the runs leave, each
// run waits for the whole tail before its segment's first tail chunk. At the launcher's share
// (the cap of 0.5 here: 7 runs of 4 heads leave ~100 multiprocessors) and a small forced one.
TEST_F(GpuPrefill, SplitPrepTailMatchesOnePrepGridBitForBit) {
  setenv("FLASHKDA_SPLIT", "1", 1);
  setenv("FLASHKDA_SPLIT_SEGMENTS", "4", 1);
  setenv("FLASHKDA_SPLIT_FUSED", "0", 1);  // the safe gate's split too on the wgmma runs (the fused ones have no prep)
  expect_prep_tail_bit_for_bit(3000, 4, 36, "0.1");
  unsetenv("FLASHKDA_SPLIT_FUSED");
  unsetenv("FLASHKDA_SPLIT_SEGMENTS");
  unsetenv("FLASHKDA_SPLIT");
}

// The case compute-sanitizer runs (memcheck, racecheck, synccheck): small, varlen, states.
TEST_F(GpuPrefill, SmallVarlenWithStates) { expect_matches_oracle(packed({20, 0, 1, 35}, 2, 20)); }

// The prep tail at its smallest (69 chunks, the fewest it takes is 64), one call beside the 8x1
// pass and one beside the split pass: the form the sanitizers run, since racecheck needs ~16 s a
// call of the bit-for-bit tests above.
TEST_F(GpuPrefill, SmallPrepTail) {
  setenv("FLASHKDA_STATE_CONFIG", "8x1", 1);
  expect_matches_oracle(packed({1100}, 2, 35));
  unsetenv("FLASHKDA_STATE_CONFIG");
  setenv("FLASHKDA_SPLIT", "1", 1);  // the wgmma split pass's tail: 3 segments of 23 chunks, 11 of each in the tail
  setenv("FLASHKDA_SPLIT_SEGMENTS", "3", 1);
  setenv("FLASHKDA_SPLIT_FUSED", "0", 1);
  expect_matches_oracle(packed({1100}, 2, 38));
  unsetenv("FLASHKDA_SPLIT_FUSED");
  unsetenv("FLASHKDA_SPLIT_SEGMENTS");
  unsetenv("FLASHKDA_SPLIT");
}

// A plain call, the persistent pass (started programmatically after the prep grid, which zeroes
// its item counter) and calls with a prep tail (one sequence, 8x1 and the split pass: a second
// prep grid beside the state grid, which starts programmatically and waits for its records), each
// on a non-default stream and captured into a CUDA graph, replayed twice (the graph zeroes the
// hand-offs again).
TEST_F(GpuPrefill, NonDefaultStreamAndGraphCapture) {
  const std::vector<SwitchForm> forms = {{nullptr, nullptr, {100, 33}, 4},
                                         {"FLASHKDA_PERSISTENT", "1", {100, 33}, 4},    // after prep (PDL)
                                         {"FLASHKDA_STATE_CONFIG", "8x1", {1500}, 6},   // a prep tail
                                         {"FLASHKDA_SPLIT", "1", {1500}, 6}};           // the split pass's tail
  for (const SwitchForm& form : forms) {
    SCOPED_TRACE(form.variable ? std::string(form.variable) + "=" + form.value : std::string("the launcher's choice"));
    if (form.variable) setenv(form.variable, form.value, 1);
    RandomProblem host(packed(form.lens, form.heads, 21));
    DeviceProblem dev(host);
    cudaStream_t stream;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    dev.poison_outputs();
    dev.run(stream);
    const std::vector<uint16_t> direct = dev.out();

    // Capture forward into a graph: no host synchronisation may happen inside.
    const ForwardArgs a = dev.args();
    void* ws = nullptr;
    const size_t ws_bytes = forward_workspace_size(a);
    check_cuda(cudaMalloc(&ws, ws_bytes), "workspace");
    dev.poison_outputs();
    cudaGraph_t graph;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    forward(a, ws, ws_bytes, stream);
    check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
    cudaGraphExec_t exec;
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
    check_cuda(cudaStreamSynchronize(stream), "graph sync");
    EXPECT_TRUE(dev.out() == direct) << "graph replay differs from the direct call";
    dev.poison_outputs();  // a second replay: nothing the first one left in the workspace matters
    check_cuda(cudaGraphLaunch(exec, stream), "graph relaunch");
    check_cuda(cudaStreamSynchronize(stream), "graph resync");
    EXPECT_TRUE(dev.out() == direct) << "the second graph replay differs from the direct call";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(ws);
    cudaStreamDestroy(stream);
    if (form.variable) unsetenv(form.variable);
  }
}

// A NaN or Inf planted in any input propagates as in the oracle (docs/contract.md; the rule is
// testing::non_finite_violation). The default state pass, and the 1x4 layout whose key parts
// sum partial products through shared memory.
TEST_F(GpuPrefill, NonFiniteInputsPropagateAsInTheOracle) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const char* layout : {"", "1x4"}) {
    if (*layout) setenv("FLASHKDA_STATE_CONFIG", layout, 1);
    for (Input which : kAllInputs)
      for (float value : {nan, inf, -inf}) {
        ProblemSpec s = packed({40, 37}, 2, 600);
        s.init_dtype = s.final_dtype = DType::kF32;
        RandomProblem host(s);
        const bool state = which == Input::kInitialState;
        set_input_value(host, which, state ? 1 : 40 + 20, 1, state ? 1000 : 5, value);
        DeviceProblem dev(host);
        const DeviceProblem::Outputs got = dev.run_fresh();
        const std::vector<uint16_t>& out = got.out;
        const std::vector<uint8_t>& state_bytes = got.final_state;
        const Problem& p = host.problem();
        std::vector<double> ref_out(host.out_size()), ref_state(host.state_size());
        oracle_forward(p, ref_out.data(), ref_state.data());
        size_t nonfinite_ref = 0;
        const std::string why = non_finite_violation(p, ref_out.data(), out.data(), ref_state.data(),
                                                      state_bytes.data(), kBar, &nonfinite_ref);
        EXPECT_EQ(why, "") << "layout '" << layout << "', " << input_name(which) << " = " << value;
        if (why.empty() && value != value) EXPECT_GT(nonfinite_ref, 0u) << input_name(which) << " = NaN";
      }
    unsetenv("FLASHKDA_STATE_CONFIG");
  }
}

// The exact aliases the API supports (out = q, k or g; final_state = initial_state) give the
// result of separate buffers bit for bit, on every state-pass form: per-item (two layouts),
// persistent and split.
TEST_F(GpuPrefill, ExactAliasesGiveTheSeparateResult) {
  const SwitchForm forms[] = {{"FLASHKDA_STATE_CONFIG", "8x1", {300, 17, 64}},
                        {"FLASHKDA_STATE_CONFIG", "1x4", {300, 17, 64}},
                        {"FLASHKDA_PERSISTENT", "1", {300, 17, 64}},
                        {"FLASHKDA_SPLIT", "1", {1000}},
                        {"FLASHKDA_CUDA_KERNELS", "recurrent", {300, 17, 64}},
                        {"FLASHKDA_CUDA_KERNELS", "recurrent", {1, 4, 0, 2}}};
  for (const SwitchForm& form : forms) {
    setenv(form.variable, form.value, 1);
    const ProblemSpec s = packed(form.lens, form.heads, 610);
    RandomProblem host(s);
    DeviceProblem separate(host);
    separate.poison_outputs();
    separate.run();
    const std::vector<uint16_t> expected_out = separate.out();
    const std::vector<uint8_t> expected_state = separate.final_state();
    for (int input = 0; input < 3; ++input) {
      DeviceProblem dev(host);
      ForwardArgs a = dev.args();
      Tensor& in = input == 0 ? a.q : input == 1 ? a.k : a.g;
      a.out.data = in.data;
      a.final_state.data = a.initial_state.data;
      void* ws = nullptr;
      const size_t bytes = forward_workspace_size(a);
      check_cuda(cudaMalloc(&ws, bytes > 0 ? bytes : 1), "workspace");
      forward(a, ws, bytes, nullptr);
      check_cuda(cudaDeviceSynchronize(), "aliased forward");
      cudaFree(ws);
      std::vector<uint16_t> out(expected_out.size());
      std::vector<uint8_t> state(expected_state.size());
      check_cuda(cudaMemcpy(out.data(), a.out.data, out.size() * 2, cudaMemcpyDeviceToHost), "out");
      check_cuda(cudaMemcpy(state.data(), a.final_state.data, state.size(), cudaMemcpyDeviceToHost), "state");
      EXPECT_TRUE(out == expected_out) << form.variable << "=" << form.value << ", out = " << "qkg"[input];
      EXPECT_TRUE(state == expected_state) << form.variable << "=" << form.value << ", final_state = initial_state";
    }
    unsetenv(form.variable);
  }
}

// --- Errors on the CUDA path ---

ErrorCode run_expecting_error(DeviceProblem& dev, const ForwardArgs& a, std::string* message) {
  try {
    void* ws = nullptr;
    const size_t bytes = 1 << 26;
    check_cuda(cudaMalloc(&ws, bytes), "workspace");
    try {
      forward(a, ws, bytes, nullptr);
    } catch (...) {
      cudaFree(ws);
      throw;
    }
    cudaFree(ws);
  } catch (const Error& e) {
    *message = e.what();
    return e.code();
  }
  (void)dev;
  return ErrorCode::kOk;
}

// The softplus gate with Kimi-Linear-like parameters: A_log in [-1, 2.7], g + dt_bias up to +-30
// (decays from none to a full wipe within a token). Long calls run the chunked prefill, whose
// chunk form must stay finite and exact where a chunk's decay spans thousands of nats; whole
// chunks of near-zero decay (g + dt_bias = -30: softplus 1e-13, summed over many tokens), of
// wiping decay (+30) and of per-channel mixes alternate, with lengths around the chunk size.
RandomProblem& kimi_softplus(RandomProblem& host, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> a_log(-1.0f, 2.7f), bias(-22.0f, 22.0f), wide(-30.0f, 30.0f);
  for (float& a : host.A_log) a = a_log(rng);
  for (float& b : host.dt_bias) b = bias(rng);
  const Problem& p = host.problem();
  for (int64_t t = 0; t < p.total_tokens; ++t) {
    const int regime = static_cast<int>((t / 16 + seed) % 4);  // per 16 tokens of the packed rows
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t c = 0; c < 128; ++c) {
        const float bias_hc = host.dt_bias[h * 128 + c];
        float x = wide(rng);
        if (regime == 0) x = -30.0f;  // near-zero decay everywhere
        if (regime == 1) x = 30.0f;   // a wipe every token
        if (regime == 2 && (t % 16) == 5) x = 30.0f;  // one wiping token inside a quiet chunk
        if (regime == 2 && (t % 16) != 5) x = -30.0f;
        host.g[(t * p.H + h) * 128 + c] = float_to_bf16(x - bias_hc);
      }
  }
  return host;
}

TEST_F(GpuPrefill, SoftplusGateMatchesOracle) {
  ProblemSpec spec = packed({40, 0, 1, 17, 300, 1000}, 3, 22);
  spec.gate = Gate::kSoftplus;
  {
    RandomProblem host(spec);
    expect_matches_oracle(kimi_softplus(host, 22));
  }
  spec.g_input = GateInput::kUniform8;  // the generator's own wide gates, no regimes
  spec.dt_bias_input = DtBiasInput::kWide;
  expect_matches_oracle(spec);
  spec.seqlens = {1, 3, 8, 2};  // decode-shaped: the recurrent kernel
  expect_matches_oracle(spec);
  ProblemSpec large = packed({700}, 2, 23);  // a large fp32 state that near-zero decay keeps
  large.gate = Gate::kSoftplus;
  large.init = InitState::kLarge;
  large.init_dtype = large.final_dtype = DType::kF32;
  RandomProblem host(large);
  expect_matches_oracle(kimi_softplus(host, 24));
}

// The softplus gate on every state-pass form of the chunked prefill (the split pass takes a
// single sequence).
TEST_F(GpuPrefill, SoftplusGateEveryStatePass) {
  struct Env {
    const char* variable;
    const char* value;
  };
  const std::vector<std::vector<Env>> forms = {
      {{"FLASHKDA_STATE_CONFIG", "8x1"}}, {{"FLASHKDA_STATE_CONFIG", "4x1"}}, {{"FLASHKDA_STATE_CONFIG", "2x2"}},
      {{"FLASHKDA_STATE_CONFIG", "1x4"}}, {{"FLASHKDA_SPLIT", "1"}},          {{"FLASHKDA_PERSISTENT", "1"}}};
  for (const std::vector<Env>& form : forms) {
    for (const Env& e : form) setenv(e.variable, e.value, 1);
    setenv("FLASHKDA_CUDA_KERNELS", "chunked", 1);
    SCOPED_TRACE(std::string(form[0].variable) + "=" + form[0].value);
    const bool split = std::string(form[0].variable) == "FLASHKDA_SPLIT";  // one sequence only
    ProblemSpec spec = packed(split ? std::vector<int64_t>{1000} : std::vector<int64_t>{300, 0, 17, 1, 64}, 3, 28);
    spec.gate = Gate::kSoftplus;
    spec.init_dtype = spec.final_dtype = DType::kF32;
    RandomProblem host(spec);
    expect_matches_oracle(kimi_softplus(host, 29));
    for (const Env& e : form) unsetenv(e.variable);
    unsetenv("FLASHKDA_CUDA_KERNELS");
  }
}

// The state pass starts programmatically after the prep grid (its producer waits for that grid
// before the first record; 16 heads: enough blocks that 4x1 and 2x2 take it too);
// FLASHKDA_STATE_PDL=0 launches it plainly. The two agree bit for bit, twice in a row (the second
// call's prep must not overtake the first call's state pass).
TEST_F(GpuPrefill, StateAfterPrepMatchesPlainLaunchBitForBit) {
  const std::vector<std::pair<const char*, const char*>> forms = {
      {"FLASHKDA_STATE_CONFIG", "8x1"}, {"FLASHKDA_STATE_CONFIG", "4x1"}, {"FLASHKDA_STATE_CONFIG", "2x2"},
      {"FLASHKDA_STATE_CONFIG", "1x4"}, {"FLASHKDA_SPLIT", "1"},          {"FLASHKDA_PERSISTENT", "1"}};
  for (const auto& [variable, value] : forms) {
    setenv(variable, value, 1);
    setenv("FLASHKDA_CUDA_KERNELS", "chunked", 1);
    SCOPED_TRACE(std::string(variable) + "=" + value);
    const bool split = std::string(variable) == "FLASHKDA_SPLIT";  // one sequence only
    RandomProblem host(packed(split ? std::vector<int64_t>{1000} : std::vector<int64_t>{300, 0, 17, 1, 64}, 16, 36));
    DeviceProblem dev(host);
    setenv("FLASHKDA_STATE_PDL", "0", 1);
    const DeviceProblem::Outputs base = dev.run_fresh();
    unsetenv("FLASHKDA_STATE_PDL");
    for (int run = 0; run < 2; ++run) expect_same_outputs(dev, base, "after prep, run " + std::to_string(run));
    expect_matches_oracle(host);
    unsetenv(variable);
    unsetenv("FLASHKDA_CUDA_KERNELS");
  }
}

// The split pass's stitch forms on mma.sync give the same results bit for bit: the segment states
// chained in one launch (FLASHKDA_STITCH_CHAIN, the default) or a launch a step (=0), the out rows
// by blocks that keep M across tiles (FLASHKDA_STITCH_ROWS, the default) or a block a tile (=0).
// 2 to 8 segments, a bf16, an fp32 or no final state (the chain then stops a step early); a long
// sequence where the row blocks take several tiles each across (segment, head) boundaries
// (T = 20000, 4 heads: ~630 tiles on at most one block a multiprocessor). Then the default, whose
// kept rows run on wgmma (FLASHKDA_STITCH_ROWS_WGMMA: other rounding, not bit for bit), against
// the oracle on every case.
TEST_F(GpuPrefill, StitchExperimentsMatchTheDefaultBitForBit) {
  struct Case {
    const char* segments;
    int64_t tokens, heads;
    int final_form;  // 0: bf16, 1: fp32, 2: none
  };
  std::vector<Case> cases;
  for (const char* segments : {"2", "3", "5", "8"})
    for (int final_form = 0; final_form < 3; ++final_form) cases.push_back({segments, 2000, 3, final_form});
  cases.push_back({"2", 20000, 4, 0});
  cases.push_back({"3", 20000, 4, 1});
  const std::vector<std::vector<const char*>> variants = {
      {"FLASHKDA_STITCH_CHAIN"}, {"FLASHKDA_STITCH_ROWS"}, {"FLASHKDA_STITCH_CHAIN", "FLASHKDA_STITCH_ROWS"}};
  setenv("FLASHKDA_SPLIT", "1", 1);
  setenv("FLASHKDA_STITCH_ROWS_WGMMA", "0", 1);
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.segments) + " segments, T = " + std::to_string(c.tokens) + ", final state " +
                 (c.final_form == 0 ? "bf16" : c.final_form == 1 ? "fp32" : "none"));
    setenv("FLASHKDA_SPLIT_SEGMENTS", c.segments, 1);
    ProblemSpec spec = packed({c.tokens}, c.heads, 39);
    spec.final_state = c.final_form != 2;
    spec.final_dtype = c.final_form == 1 ? DType::kF32 : DType::kBF16;
    spec.init_dtype = spec.final_dtype;  // the library takes both states in one dtype
    RandomProblem host(spec);
    DeviceProblem dev(host);
    setenv("FLASHKDA_STITCH_CHAIN", "0", 1);  // the first stitch: a launch a step, a block a tile
    setenv("FLASHKDA_STITCH_ROWS", "0", 1);
    const DeviceProblem::Outputs base = dev.run_fresh();
    for (const std::vector<const char*>& variant : variants) {
      std::string name;
      for (const char* v : variant) setenv(v, "1", 1), name += std::string(v) + "=1 ";
      expect_same_outputs(dev, base, name);
      for (const char* v : variant) setenv(v, "0", 1);
    }
    unsetenv("FLASHKDA_STITCH_CHAIN");  // both, as the default has them
    unsetenv("FLASHKDA_STITCH_ROWS");
    expect_same_outputs(dev, base, "the kept rows on mma.sync");
    unsetenv("FLASHKDA_STITCH_ROWS_WGMMA");  // the default
    expect_matches_oracle(host);
    setenv("FLASHKDA_STITCH_ROWS_WGMMA", "0", 1);
  }
  unsetenv("FLASHKDA_STITCH_ROWS_WGMMA");
  unsetenv("FLASHKDA_SPLIT_SEGMENTS");
  unsetenv("FLASHKDA_SPLIT");
}

// Both stitch forms at a size the sanitizers run, the out rows' products in 2xTF32 (the default;
// the kept rows on wgmma or mma.sync) and 3xTF32: three segments, one call each against the oracle.
TEST_F(GpuPrefill, SmallStitchExperiments) {
  setenv("FLASHKDA_SPLIT", "1", 1);
  setenv("FLASHKDA_SPLIT_SEGMENTS", "3", 1);
  for (const char* form : {"0", "1"})
    for (const char* precise : {"0", "1"})
      for (const char* wgmma : {"0", "1"}) {
        if (wgmma[0] == '1' && (form[0] == '0' || precise[0] == '1')) continue;  // only the kept 2xTF32 rows have it
        SCOPED_TRACE(std::string("FLASHKDA_STITCH_CHAIN and _ROWS = ") + form + ", FLASHKDA_STITCH_3XTF32 = " +
                     precise + ", FLASHKDA_STITCH_ROWS_WGMMA = " + wgmma);
        setenv("FLASHKDA_STITCH_CHAIN", form, 1);
        setenv("FLASHKDA_STITCH_ROWS", form, 1);
        setenv("FLASHKDA_STITCH_3XTF32", precise, 1);
        setenv("FLASHKDA_STITCH_ROWS_WGMMA", wgmma, 1);
        expect_matches_oracle(packed({600}, 2, 40));
      }
  for (const char* v : {"FLASHKDA_STITCH_3XTF32", "FLASHKDA_STITCH_ROWS", "FLASHKDA_STITCH_CHAIN",
                        "FLASHKDA_STITCH_ROWS_WGMMA", "FLASHKDA_SPLIT_SEGMENTS", "FLASHKDA_SPLIT"})
    unsetenv(v);
}

// What the chunked prefill does not implement (per-token states; strided views its loads cannot
// take) runs on the recurrent kernel; forced onto the chunked kernels (FLASHKDA_CUDA_KERNELS=
// chunked), such a call is refused by name, before any kernel runs.
TEST_F(GpuPrefill, ChunkedPrefillRefusesWhatItLacks) {
  struct ForceChunked {
    ForceChunked() { setenv("FLASHKDA_CUDA_KERNELS", "chunked", 1); }
    ~ForceChunked() { unsetenv("FLASHKDA_CUDA_KERNELS"); }
  } force;
  RandomProblem host(packed({10, 7}, 1, 26));
  DeviceProblem dev(host);
  ForwardArgs a = dev.args();
  std::string msg;
  // a strided q with rows 8-byte but not 16-byte aligned (132 elements apart, H = 1)
  a.q.strides[0] = 17 * 128, a.q.strides[1] = 132, a.q.strides[2] = 128, a.q.strides[3] = 1;
  a.q.shape[1] = 8;
  a.k.shape[1] = a.v.shape[1] = a.g.shape[1] = a.out.shape[1] = a.beta.shape[1] = 8;
  a.cu_seqlens = Tensor{};
  a.initial_state.shape[0] = a.final_state.shape[0] = 1;
  EXPECT_EQ(run_expecting_error(dev, a, &msg), ErrorCode::kUnsupported);
  EXPECT_THAT(msg, ::testing::HasSubstr("the chunked prefill reads strided views only with 16-byte aligned rows"));
}

TEST_F(GpuPrefill, BadDeviceCuSeqlensRefused) {
  for (const std::vector<int64_t>& cu : {std::vector<int64_t>{0, 30, 20, 40}, std::vector<int64_t>{0, 10, 20, 39},
                                         std::vector<int64_t>{1, 10, 20, 40}}) {
    RandomProblem host(packed({10, 10, 20}, 2, 23));
    DeviceProblem dev(host);
    ForwardArgs a = dev.args();
    check_cuda(cudaMemcpy(a.cu_seqlens.data, cu.data(), cu.size() * 8, cudaMemcpyHostToDevice), "cu_seqlens");
    std::string msg;
    EXPECT_EQ(run_expecting_error(dev, a, &msg), ErrorCode::kInvalidArgument);
    EXPECT_THAT(msg, ::testing::HasSubstr("cu_seqlens"));
  }
}

// With host checks off, bad cu_seqlens give an undefined result but never an out-of-bounds access.
TEST_F(GpuPrefill, BadCuSeqlensWithDeviceGuardsStayInBounds) {
  RandomProblem host(packed({10, 10, 20}, 2, 24));
  DeviceProblem dev(host);
  ForwardArgs a = dev.args();
  const std::vector<int64_t> cu = {5, 1000, -7, 3};
  check_cuda(cudaMemcpy(a.cu_seqlens.data, cu.data(), cu.size() * 8, cudaMemcpyHostToDevice), "cu_seqlens");
  a.seqlen_check = SeqlenCheck::kDeviceGuardsOnly;
  dev.poison_outputs();
  std::string msg;
  EXPECT_EQ(run_expecting_error(dev, a, &msg), ErrorCode::kOk) << msg;
  check_cuda(cudaDeviceSynchronize(), "kernels with bad cu_seqlens");
  EXPECT_TRUE(dev.guards_intact());
}

TEST_F(GpuPrefill, WorkspaceTooSmallRefused) {
  RandomProblem host(packed({100}, 2, 25));
  DeviceProblem dev(host);
  const ForwardArgs a = dev.args();
  const size_t need = forward_workspace_size(a);
  void* ws = nullptr;
  check_cuda(cudaMalloc(&ws, need), "workspace");
  try {
    forward(a, ws, need - 1, nullptr);
    ADD_FAILURE() << "no error for a workspace one byte short";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr("workspace"));
  }
  cudaFree(ws);
}

}  // namespace
}  // namespace flashkda::testing
