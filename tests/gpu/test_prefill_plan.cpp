// The CUDA prefill's plan (PrefillPlan, plan_prefill in prefill_launch.cu) for the benchmark's
// cases on the H200's 132 multiprocessors: which state pass, layout, prep tail and split each
// one takes, and what the FLASHKDA_* overrides change. The plan reads shapes, flags and the
// environment only, so these run without a device (the CI machine too): a change of rule that
// moves a measured case onto another path shows here before any GPU run. The choices pinned are
// those docs/perf-notes.md measured (versions table).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "common/problem.h"
#include "gpu/gpu_backend.h"

namespace flashkda {
namespace {

using gpu::PrefillPlan;
using Pass = PrefillPlan::Pass;

constexpr int kH200Multiprocessors = 132;

// Never read: the plan only asks whether cu_seqlens is given (its values are device data).
const int64_t kUnreadOffsets[1] = {0};

// A packed call of these sequence lengths on H heads with bf16 initial and final states, as the
// benchmark runs them (docs/benchmark.md); no data, only the shapes the plan reads.
Problem shapes(const std::vector<int64_t>& lens, int64_t heads) {
  Problem p;
  p.K = p.V = 128;
  p.H = heads;
  p.N = static_cast<int64_t>(lens.size());
  p.total_tokens = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  p.B = 1;
  p.T = p.total_tokens;
  if (lens.size() > 1) p.cu_seqlens = kUnreadOffsets;
  p.initial_state_dtype = p.final_state_dtype = DType::kBF16;
  p.initial_slots = p.final_slots = p.N;
  return p;
}

PrefillPlan plan(const std::vector<int64_t>& lens, int64_t heads) {
  return gpu::plan_prefill(shapes(lens, heads), kH200Multiprocessors);
}

// Sets FLASHKDA_* variables for one scope.
struct ScopedEnv {
  std::vector<const char*> names;
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) setenv(name, value, 1), names.push_back(name);
  }
  ~ScopedEnv() {
    for (const char* name : names) unsetenv(name);
  }
};

const std::vector<int64_t> kUneven = {1300, 547, 2048, 963, 271, 3063};

TEST(PrefillPlan, OneSequenceManyHeadsRunsEightByOneBesideAPrepTail) {  // P1
  const PrefillPlan p = plan({8192}, 96);
  EXPECT_EQ(p.pass, Pass::kPerItem);
  EXPECT_EQ(p.value_slices, 8);
  EXPECT_EQ(p.key_parts, 1);
  EXPECT_EQ(p.tail_sms, kH200Multiprocessors - 96);  // the multiprocessors the 96 chains leave
  EXPECT_GT(p.tail_first_slot, 8192 / 16 / 2);        // the tail takes a minority of the chunks
  EXPECT_LT(p.tail_first_slot, 8192 / 16);
  EXPECT_FALSE(p.state_after_prep);  // the state grid follows the tail's grid instead
  EXPECT_EQ(p.record_bytes % (512 * 96), 0u);
  EXPECT_GE(p.workspace_bytes(), p.record_bytes + p.tail_bytes);
}

TEST(PrefillPlan, SeveralSequencesManyHeadsRunThePersistentPass) {  // P2, P3, P5, P6, P9
  for (const auto& [lens, heads] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {kUneven, 96}, {std::vector<int64_t>(8, 1024), 96}, {kUneven, 64}, {std::vector<int64_t>(8, 1024), 64},
           {std::vector<int64_t>(64, 128), 32}}) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan(lens, heads);
    EXPECT_EQ(p.pass, Pass::kPersistent);
    EXPECT_EQ(p.value_slices, 8);
    EXPECT_EQ(p.tail_sms, 0);
    EXPECT_TRUE(p.state_after_prep);
    EXPECT_EQ(p.counter_bytes, 128u + lens.size() * sizeof(int));  // the item counter, then the length order
  }
}

TEST(PrefillPlan, FewItemsRunFourByOneWithoutProgrammaticLaunch) {  // P4, P10
  for (const auto& [lens, heads] :
       std::vector<std::pair<std::vector<int64_t>, int64_t>>{{{8192}, 64}, {std::vector<int64_t>(4, 16384), 16}}) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan(lens, heads);
    EXPECT_EQ(p.pass, Pass::kPerItem);
    EXPECT_EQ(p.value_slices, 4);
    EXPECT_EQ(p.key_parts, 1);
    EXPECT_EQ(p.tail_sms, 0);           // 128 blocks leave 4 multiprocessors, fewer than a tail takes
    EXPECT_FALSE(p.state_after_prep);  // two blocks a multiprocessor would pack where the prep grid drains
  }
}

TEST(PrefillPlan, OneLongSequenceFewHeadsIsSplitOnTheWgmmaPass) {  // P7, P8, P11
  struct Case {
    int64_t tokens, heads;
    int segments;  // the most whose 2S - 1 runs of H blocks fit 132, segments >= 3840 tokens, <= 17
  };
  for (const Case& c : {Case{32768, 8, 8}, Case{65536, 4, 17}, Case{131072, 8, 8}}) {
    SCOPED_TRACE(std::to_string(c.tokens) + " tokens x " + std::to_string(c.heads) + " heads");
    const PrefillPlan p = plan({c.tokens}, c.heads);
    EXPECT_EQ(p.pass, Pass::kSplit);
    EXPECT_EQ(p.split_segments, c.segments);
    EXPECT_LE((2 * c.segments - 1) * c.heads, kH200Multiprocessors);  // one wave
    EXPECT_TRUE(p.split_wgmma);
    EXPECT_TRUE(p.wgmma_records());
    EXPECT_TRUE(p.stitch_chain_launch);
    EXPECT_TRUE(p.stitch_rows_kept);
    EXPECT_TRUE(p.stitch_rows_wgmma);
    EXPECT_FALSE(p.stitch_rows_3xtf32);
    EXPECT_EQ(p.split_row_bytes, static_cast<size_t>(c.tokens * c.heads) * 128 * sizeof(float));
  }
  // Shorter: fewer segments of at least 3840 tokens; under three, no split (the stitch costs more).
  EXPECT_EQ(plan({16384}, 4).split_segments, 4);
  EXPECT_NE(plan({8192}, 4).pass, Pass::kSplit);
}

TEST(PrefillPlan, OverridesChangeWhatTheySay) {
  {
    const ScopedEnv env{{"FLASHKDA_SPLIT_SEGMENTS", "12"}, {"FLASHKDA_STITCH_ROWS_WGMMA", "0"}};
    const PrefillPlan p = plan({65536}, 4);
    EXPECT_EQ(p.split_segments, 12);
    EXPECT_FALSE(p.stitch_rows_wgmma);
  }
  {
    const ScopedEnv env{{"FLASHKDA_PREP_TAIL", "0"}};
    const PrefillPlan p = plan({8192}, 96);
    EXPECT_EQ(p.tail_sms, 0);
    EXPECT_TRUE(p.state_after_prep);  // without a tail, programmatically after the prep grid
  }
  {
    const ScopedEnv env{{"FLASHKDA_STATE_WGMMA", "1"}};
    const PrefillPlan p = plan({8192}, 96);
    EXPECT_EQ(p.pass, Pass::kWgmma);
    EXPECT_TRUE(p.wgmma_records());
  }
  {
    const ScopedEnv env{{"FLASHKDA_SPLIT", "0"}};
    EXPECT_NE(plan({32768}, 8).pass, Pass::kSplit);
  }
}

// plan_prefill refuses the problem under `env` with `code`, its message naming `what`.
void expect_refused(std::initializer_list<std::pair<const char*, const char*>> env, const Problem& problem,
                    ErrorCode code, const std::string& what) {
  SCOPED_TRACE(what);
  try {
    const ScopedEnv scoped(env);
    gpu::plan_prefill(problem, kH200Multiprocessors);
    ADD_FAILURE() << "planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(PrefillPlan, RefusesWhatItCannotPlan) {
  expect_refused({{"FLASHKDA_SPLIT_SEGMENTS", "33"}}, shapes({65536}, 4), ErrorCode::kInvalidArgument,
                 "FLASHKDA_SPLIT_SEGMENTS");
  expect_refused({{"FLASHKDA_PREP_TAIL_SHARE", "2"}}, shapes({8192}, 96), ErrorCode::kInvalidArgument,
                 "FLASHKDA_PREP_TAIL_SHARE");
  Problem k64 = shapes({1024}, 4);
  k64.K = 64;
  expect_refused({}, k64, ErrorCode::kUnsupported, "K = 64");
}

}  // namespace
}  // namespace flashkda
