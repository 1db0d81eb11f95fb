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
#include <tuple>
#include <vector>

#include "common/problem.h"
#include "gpu/gpu_backend.h"
#include "gpu/prefill/tail_chunks.h"

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

TEST(PrefillPlan, OneSequenceManyHeadsRunsEightByOneBesideAPrepTail) {  // P1 on the two-kernel path
  const ScopedEnv two_kernels{{"FLASHKDA_FUSED", "0"}};
  const PrefillPlan p = plan({8192}, 96);
  EXPECT_EQ(p.pass, Pass::kPerItem);
  EXPECT_EQ(p.value_slices, 8);
  EXPECT_EQ(p.key_parts, 1);
  EXPECT_EQ(p.tail_sms, kH200Multiprocessors - 96);  // the multiprocessors the 96 chains leave
  EXPECT_GT(p.tail_per_segment, 0);                   // the tail takes a minority of the chunks
  EXPECT_LT(p.tail_per_segment, 8192 / 16 / 2);
  EXPECT_FALSE(p.state_after_prep);  // the state grid follows the tail's grid instead
  EXPECT_EQ(p.record_bytes % (512 * 96), 0u);
  EXPECT_GE(p.workspace_bytes(), p.record_bytes + p.tail_bytes);
}

// Sequences of 256 tokens or more on average, on items for 70% of the multiprocessors or more:
// the fused prefill, longest sequences first, no workspace.
TEST(PrefillPlan, LongSequencesOnManyItemsRunTheFusedPrefill) {  // P2, P3, P5, P6; P1 below
  for (const auto& [lens, heads] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {kUneven, 96}, {std::vector<int64_t>(8, 1024), 96}, {kUneven, 64}, {std::vector<int64_t>(8, 1024), 64}}) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan(lens, heads);
    EXPECT_EQ(p.pass, Pass::kFused);
    EXPECT_TRUE(p.fused_longest_first);
    EXPECT_EQ(p.workspace_bytes(), 0u);
  }
  // P1: one sequence on 96 items of 132 (73%), so nothing to rank; 92 items (69.7%) stay on the
  // two-kernel path, 93 (70.5%) take the fused one.
  EXPECT_EQ(plan({8192}, 96).pass, Pass::kFused);
  EXPECT_FALSE(plan({8192}, 96).fused_longest_first);
  EXPECT_NE(plan({8192}, 92).pass, Pass::kFused);
  EXPECT_EQ(plan({8192}, 93).pass, Pass::kFused);
  EXPECT_EQ(plan({4096, 4096}, 47).pass, Pass::kFused);  // 94 items
  EXPECT_NE(plan({4096, 4096}, 46).pass, Pass::kFused);  // 92
  // Sequences of 256 and 512 tokens (measured 3% and 20% under the two-kernel path), not of 255.
  EXPECT_EQ(plan(std::vector<int64_t>(32, 256), 32).pass, Pass::kFused);
  EXPECT_EQ(plan(std::vector<int64_t>(16, 512), 32).pass, Pass::kFused);
  EXPECT_NE(plan(std::vector<int64_t>(32, 255), 32).pass, Pass::kFused);
  // Not where it lost: P7, P8, P11 (4 to 8 items), P9 (128 tokens a sequence); nor where it
  // lacks a feature (the two-kernel path, no refusal). P4 and P10: in pairs, below.
  for (const auto& [lens, heads] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {{32768}, 8}, {{65536}, 4}, {{131072}, 8}, {std::vector<int64_t>(64, 128), 32}}) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    EXPECT_NE(plan(lens, heads).pass, Pass::kFused);
  }
  // Longest first only for packed sequences (cu_seqlens), at most 64 of them (each block ranks
  // them itself), and not with FLASHKDA_SEQ_ORDER=0.
  const PrefillPlan many = plan(std::vector<int64_t>(65, 1024), 96);
  EXPECT_EQ(many.pass, Pass::kFused);
  EXPECT_FALSE(many.fused_longest_first);
  Problem batch = shapes(std::vector<int64_t>(8, 1024), 96);
  batch.cu_seqlens = nullptr, batch.B = 8, batch.T = 1024;  // [B, T]: sequences of equal length
  EXPECT_EQ(gpu::plan_prefill(batch, kH200Multiprocessors).pass, Pass::kFused);
  EXPECT_FALSE(gpu::plan_prefill(batch, kH200Multiprocessors).fused_longest_first);
  {
    const ScopedEnv index_order({{"FLASHKDA_SEQ_ORDER", "0"}});
    EXPECT_FALSE(plan(kUneven, 96).fused_longest_first);
  }
  Problem softplus = shapes(std::vector<int64_t>(8, 1024), 96);
  softplus.gate = Gate::kSoftplus;
  EXPECT_EQ(gpu::plan_prefill(softplus, kH200Multiprocessors).pass, Pass::kPersistent);
  Problem pools = shapes(std::vector<int64_t>(8, 1024), 96);
  pools.state_indices = kUnreadOffsets;
  EXPECT_NE(gpu::plan_prefill(pools, kH200Multiprocessors).pass, Pass::kFused);
}

void expect_refused(std::initializer_list<std::pair<const char*, const char*>> env, const Problem& problem,
                    ErrorCode code, const std::string& what);  // below

// Items for 35% to 50% of the multiprocessors, sequences of 2048 tokens or more on average: the
// fused prefill in pairs (two blocks an item), the one-block form above them.
TEST(PrefillPlan, FewLongItemsRunTheFusedPrefillInPairs) {  // P4, P10
  for (const auto& [lens, heads] :
       std::vector<std::pair<std::vector<int64_t>, int64_t>>{{{8192}, 64}, {std::vector<int64_t>(4, 16384), 16}, {{2048}, 66}, {{8192}, 47}}) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan(lens, heads);
    EXPECT_EQ(p.pass, Pass::kFused);
    EXPECT_TRUE(p.fused_pair);
    EXPECT_FALSE(p.fused_pair_prefetch);  // measured no better: FLASHKDA_FUSED_PAIR_PREFETCH=1 only
    EXPECT_EQ(p.workspace_bytes(), 0u);
  }
  EXPECT_FALSE(plan({8192}, 96).fused_pair);          // P1: 96 items fill 73% alone
  EXPECT_NE(plan({8192}, 67).pass, Pass::kFused);    // 134 blocks in pairs: more than one wave
  EXPECT_NE(plan({8192}, 46).pass, Pass::kFused);    // 92 blocks in pairs: under 70%
  EXPECT_NE(plan({2047}, 64).pass, Pass::kFused);    // shorter sequences
  {
    const ScopedEnv one_block({{"FLASHKDA_FUSED_PAIR", "0"}});
    EXPECT_NE(plan({8192}, 64).pass, Pass::kFused);
  }
  {
    const ScopedEnv prefetch({{"FLASHKDA_FUSED_PAIR_PREFETCH", "1"}});
    EXPECT_TRUE(plan({8192}, 64).fused_pair_prefetch);
  }
  {
    const ScopedEnv prefetch({{"FLASHKDA_FUSED_PAIR_PREFETCH", "1"}});
    EXPECT_FALSE(plan({8192}, 96).fused_pair);  // a form of the pair, not a reason to take one
  }
  expect_refused({{"FLASHKDA_FUSED_PAIR", "2"}}, shapes({8192}, 64), ErrorCode::kInvalidArgument, "FLASHKDA_FUSED_PAIR: expected 0 or 1");
  const ScopedEnv forced({{"FLASHKDA_FUSED", "1"}, {"FLASHKDA_FUSED_PAIR", "1"}});
  EXPECT_TRUE(plan({8192}, 96).fused_pair);
  EXPECT_TRUE(plan({32768}, 8).fused_pair);
}

// The two-kernel path's choice for those (FLASHKDA_FUSED=0) and for P9.
TEST(PrefillPlan, SeveralSequencesManyHeadsRunThePersistentPass) {  // P2, P3, P5, P6 (FLASHKDA_FUSED=0), P9
  const ScopedEnv two_kernels({{"FLASHKDA_FUSED", "0"}});
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

TEST(PrefillPlan, FewItemsRunFourByOneWithoutProgrammaticLaunch) {  // P4, P10 (FLASHKDA_FUSED=0)
  const ScopedEnv two_kernels({{"FLASHKDA_FUSED", "0"}});
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

TEST(PrefillPlan, OneLongSequenceFewHeadsIsSplitOnTheWgmmaPass) {  // P7, P8, P11 with FLASHKDA_SPLIT_FUSED=0
  const ScopedEnv wgmma_runs{{"FLASHKDA_SPLIT_FUSED", "0"}};
  struct Case {
    int64_t tokens, heads;
    int segments;  // the most whose 2S - 1 runs of H blocks fit 132, segments >= 3840 tokens, <= 17
    int tail_sms;  // the multiprocessors the runs leave to a prep tail (at least 8, else none)
  };
  for (const Case& c : {Case{32768, 8, 8, 12}, Case{65536, 4, 17, 0}, Case{131072, 8, 8, 12}}) {
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
    EXPECT_EQ(p.tail_sms, c.tail_sms);
    // The tail's region after the runs' buffers (they write them while the tail runs), to the end.
    EXPECT_GE(p.tail_offset(), p.record_bytes + 3 * (c.segments - 1) * p.split_state_bytes + 2 * p.split_row_bytes);
    EXPECT_EQ(p.tail_offset() + p.tail_bytes, p.workspace_bytes());
    EXPECT_EQ(p.state_after_prep, c.tail_sms == 0);  // beside a tail the state grid follows the tail's grid
    const int64_t segment_chunks = c.tokens / 16 / c.segments;
    if (c.tail_sms > 0) {  // of each segment, about 13.5% (the rates in prefill_launch.cu)
      EXPECT_GT(p.tail_per_segment, segment_chunks / 10);
      EXPECT_LT(p.tail_per_segment, segment_chunks / 5);
    } else {
      EXPECT_EQ(p.tail_per_segment, 0);
    }
  }
  // The softplus gate's prep is slower: a smaller tail (P7: about 11% of each segment, against 13.5%).
  Problem softplus = shapes({32768}, 8);
  softplus.gate = Gate::kSoftplus;
  const PrefillPlan sp = gpu::plan_prefill(softplus, kH200Multiprocessors);
  EXPECT_EQ(sp.tail_sms, 12);
  EXPECT_GT(sp.tail_per_segment, 256 / 10);
  EXPECT_LT(sp.tail_per_segment, plan({32768}, 8).tail_per_segment);
  // Shorter: fewer segments of at least 3840 tokens; under three, no split (the stitch costs more).
  EXPECT_EQ(plan({16384}, 4).split_segments, 4);
  EXPECT_NE(plan({8192}, 4).pass, Pass::kSplit);
}

// The same segments with the runs on the fused prefill (chunks of 64 tokens, each run preparing its
// own): no records, no prep tail; the stitch's buffers only. FLASHKDA_SPLIT_FUSED=0: the wgmma runs
// (the test above); the softplus gate takes them by itself.
TEST(PrefillPlan, SplitRunsOnTheFusedPrefill) {
  for (const auto& [tokens, heads, segments] : std::vector<std::tuple<int64_t, int64_t, int>>{{32768, 8, 8}, {65536, 4, 17}, {131072, 8, 8}}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan({tokens}, heads);
    EXPECT_EQ(p.pass, Pass::kSplit);
    EXPECT_TRUE(p.split_fused);
    EXPECT_EQ(p.split_segments, segments);
    EXPECT_EQ(p.record_bytes, 0u);
    EXPECT_EQ(p.tail_sms, 0);
    EXPECT_EQ(p.workspace_bytes(), 3 * (segments - 1) * p.split_state_bytes + 2 * p.split_row_bytes);
  }
  {  // a segment's two runs as one cluster: 2 S H blocks in one wave (P8: 16 segments, not 17)
    EXPECT_FALSE(plan({32768}, 8).split_shared);
    const ScopedEnv shared{{"FLASHKDA_SPLIT_SHARED", "1"}};
    for (const auto& [tokens, heads, segments] : std::vector<std::tuple<int64_t, int64_t, int>>{{32768, 8, 8}, {65536, 4, 16}, {131072, 8, 8}}) {
      const PrefillPlan p = plan({tokens}, heads);
      EXPECT_TRUE(p.split_shared);
      EXPECT_EQ(p.split_segments, segments);
      EXPECT_LE(2 * segments * heads, kH200Multiprocessors);
      EXPECT_EQ(p.workspace_bytes(), 3 * (segments - 1) * p.split_state_bytes + 2 * p.split_row_bytes);
    }
  }
  Problem softplus = shapes({32768}, 8);
  softplus.gate = Gate::kSoftplus;
  EXPECT_FALSE(gpu::plan_prefill(softplus, kH200Multiprocessors).split_fused);
  expect_refused({{"FLASHKDA_SPLIT_FUSED", "1"}}, softplus, ErrorCode::kUnsupported, "FLASHKDA_SPLIT_FUSED=1: the fused prefill does not take the softplus gate yet");
  expect_refused({{"FLASHKDA_SPLIT_FUSED", "2"}}, shapes({32768}, 8), ErrorCode::kInvalidArgument, "FLASHKDA_SPLIT_FUSED: expected 0 or 1");
}

TEST(PrefillPlan, OverridesChangeWhatTheySay) {
  // P1's two-kernel passes, P7's wgmma runs (the prep kernel's overrides)
  const ScopedEnv two_kernels{{"FLASHKDA_FUSED", "0"}, {"FLASHKDA_SPLIT_FUSED", "0"}};
  {
    const ScopedEnv env{{"FLASHKDA_SPLIT_SEGMENTS", "12"}, {"FLASHKDA_STITCH_ROWS_WGMMA", "0"}};
    const PrefillPlan p = plan({65536}, 4);
    EXPECT_EQ(p.split_segments, 12);
    EXPECT_FALSE(p.stitch_rows_wgmma);
  }
  for (const int64_t heads : {96, 8}) {  // P1, P7
    const ScopedEnv env{{"FLASHKDA_PREP_TAIL", "0"}};
    const PrefillPlan p = plan({heads == 96 ? 8192 : 32768}, heads);
    EXPECT_EQ(p.tail_sms, 0);
    EXPECT_EQ(p.tail_bytes, 0u);
    EXPECT_TRUE(p.state_after_prep);  // without a tail, programmatically after the prep grid
  }
  {
    const ScopedEnv env{{"FLASHKDA_PREP_TAIL_SHARE", "0.25"}};
    EXPECT_EQ(plan({32768}, 8).tail_per_segment, 256 / 4);  // P7: a quarter of each segment's 256 chunks
    EXPECT_EQ(plan({8192}, 96).tail_per_segment, 512 / 4);  // P1: of the sequence's 512
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

// The fp16 step takes P1's 8x1 per item beside the prep tail, P3's persistent pass and P4's 4x1,
// with checkpoints and K-major states too; F16Records replace ChunkRecords one for one. The split
// pass keeps its wgmma records. FLASHKDA_STATE_F16=0: the tf32 step everywhere. (P3 on the
// two-kernel path: FLASHKDA_FUSED=0.)
TEST(PrefillPlan, TheFp16StepTakesTheWholeSlicePasses) {
  const ScopedEnv two_kernels{{"FLASHKDA_FUSED", "0"}};
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {{{8192}, 96}, {std::vector<int64_t>(8, 1024), 96}};
  std::vector<size_t> f16_bytes;
  for (const auto& [lens, heads] : cases) {
    SCOPED_TRACE(std::to_string(lens.size()) + " sequences x " + std::to_string(heads) + " heads");
    const PrefillPlan p = plan(lens, heads);
    EXPECT_TRUE(p.state_f16);
    EXPECT_EQ(p.records(), gpu::RecordForm::kF16);
    EXPECT_EQ(p.record_bytes % 14848, 0u);  // F16Record::kBytes
    f16_bytes.push_back(p.record_bytes);
  }
  EXPECT_GT(plan({8192}, 96).tail_sms, 0);  // P1 keeps its prep tail
  EXPECT_EQ(plan({8192}, 64).value_slices, 4);  // P4: the 4x1 layout
  EXPECT_TRUE(plan({8192}, 64).state_f16);
  EXPECT_EQ(plan({8192}, 64).records(), gpu::RecordForm::kF16);
  EXPECT_FALSE(plan({32768}, 8).state_f16);  // P7: the wgmma split pass
  EXPECT_EQ(plan({32768}, 8).records(), gpu::RecordForm::kWgmma);
  Problem ckpt = shapes({8192}, 96);
  ckpt.checkpoint_offsets = kUnreadOffsets;
  ckpt.checkpoints = 1;
  EXPECT_TRUE(gpu::plan_prefill(ckpt, kH200Multiprocessors).state_f16);
  Problem k_major = shapes({8192}, 96);
  k_major.state_layout = StateLayout::kKV;
  EXPECT_TRUE(gpu::plan_prefill(k_major, kH200Multiprocessors).state_f16);
  const ScopedEnv env{{"FLASHKDA_STATE_F16", "0"}};
  EXPECT_FALSE(plan({8192}, 64).state_f16);
  for (size_t i = 0; i < cases.size(); ++i) {
    const PrefillPlan p = plan(cases[i].first, cases[i].second);
    EXPECT_FALSE(p.state_f16);
    EXPECT_EQ(p.records(), gpu::RecordForm::kTf32);
    EXPECT_EQ(p.record_bytes / 23040, f16_bytes[i] / 14848);  // as many ChunkRecords
  }
}

// The tail's chunks and the prep grid's together are every chunk once, each where holds() says;
// the tail's come position by position (every segment's first tail chunk, then its second, ...),
// each segment's in order. Geometries: P7's and P11's splits, P1's one segment, and a sequence
// whose last segment is shorter than the others.
TEST(PrefillPlan, TailChunksAndThePrepGridsCoverEveryChunkOnce) {
  for (const gpu::TailChunks t : {gpu::TailChunks{2048, 256, 37, 8}, gpu::TailChunks{8192, 1024, 149, 8},
                                  gpu::TailChunks{512, 512, 161, 1}, gpu::TailChunks{1000, 143, 20, 7}}) {
    SCOPED_TRACE(std::to_string(t.chunks) + " chunks, " + std::to_string(t.segments) + " segments, " +
                 std::to_string(t.per_segment) + " a segment in the tail");
    std::vector<int> writes(t.chunks, 0);
    for (int m = 0; m < t.chunks - t.count(); ++m) {
      const int c = t.head_chunk(m);
      ASSERT_TRUE(c >= 0 && c < t.chunks) << m;
      EXPECT_FALSE(t.holds(c)) << c;
      ++writes[c];
    }
    std::vector<int> last_of_segment(t.segments, -1);
    for (int k = 0; k < t.count(); ++k) {
      const int c = t.tail_chunk(k), s = c / t.segment_chunks;
      ASSERT_TRUE(c >= 0 && c < t.chunks) << k;
      EXPECT_TRUE(t.holds(c)) << c;
      EXPECT_EQ(s, k % t.segments);             // position by position
      EXPECT_GT(c, last_of_segment[s]) << k;    // in order within a segment
      EXPECT_EQ(t.segment_end(s) - c, t.per_segment - k / t.segments);  // the segment's last chunks
      last_of_segment[s] = c;
      ++writes[c];
    }
    for (int c = 0; c < t.chunks; ++c) EXPECT_EQ(writes[c], 1) << c;
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
  expect_refused({{"FLASHKDA_FUSED", "0"}, {"FLASHKDA_PREP_TAIL_SHARE", "2"}}, shapes({8192}, 96), ErrorCode::kInvalidArgument,
                 "FLASHKDA_PREP_TAIL_SHARE");
  Problem k64 = shapes({1024}, 4);
  k64.K = 64;
  expect_refused({}, k64, ErrorCode::kUnsupported, "K = 64");
  expect_refused({{"FLASHKDA_FUSED", "2"}}, shapes({8192}, 96), ErrorCode::kInvalidArgument, "FLASHKDA_FUSED");
}

// The fused chunk-64 prefill forced (FLASHKDA_FUSED=1) on any shape, with no workspace, and a
// forced call it cannot take is refused by the feature's name (never run on another path).
TEST(PrefillPlan, TheFusedPrefillWhenForced) {
  EXPECT_NE(plan({8192}, 32).pass, Pass::kFused);
  {
    const ScopedEnv fused({{"FLASHKDA_FUSED", "1"}});
    for (const auto& [lens, heads] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{8192}, 96}, {kUneven, 64}, {std::vector<int64_t>(64, 128), 32}, {{131072}, 8}, {{0}, 4}}) {
      const PrefillPlan p = plan(lens, heads);
      EXPECT_EQ(p.pass, Pass::kFused);
      EXPECT_EQ(p.workspace_bytes(), 0u);
      EXPECT_EQ(p.fused_split[0], 8);  // the elementwise pass's channel groups: 8, 4, 4 by default
      EXPECT_EQ(p.fused_split[1], 12);
      EXPECT_EQ(p.fused_pair, lens.size() == 1 && lens[0] == 131072);  // forced: pairs wherever they fit one wave on long sequences
    }
  }
  {
    const ScopedEnv split({{"FLASHKDA_FUSED", "1"}, {"FLASHKDA_FUSED_SPLIT", "4:10"}});
    const PrefillPlan p = plan({8192}, 96);
    EXPECT_EQ(p.fused_split[0], 4);
    EXPECT_EQ(p.fused_split[1], 10);
  }
  for (const char* bad : {"0:8", "8:8", "4:16", "4,10", "x"})
    expect_refused({{"FLASHKDA_FUSED", "1"}, {"FLASHKDA_FUSED_SPLIT", bad}}, shapes({8192}, 96), ErrorCode::kInvalidArgument,
                   "FLASHKDA_FUSED_SPLIT: expected a:b with 0 < a < b < 16");
  const std::initializer_list<std::pair<const char*, const char*>> forced = {{"FLASHKDA_FUSED", "1"}};
  Problem softplus = shapes({1024}, 4);
  softplus.gate = Gate::kSoftplus;
  expect_refused(forced, softplus, ErrorCode::kUnsupported, "the fused prefill does not take the softplus gate");
  Problem k_major = shapes({1024}, 4);
  k_major.state_layout = StateLayout::kKV;
  expect_refused(forced, k_major, ErrorCode::kUnsupported, "K-major states");
  Problem pools = shapes({1024}, 4);
  pools.state_indices = kUnreadOffsets;
  expect_refused(forced, pools, ErrorCode::kUnsupported, "state pools");
  Problem checkpoints = shapes({1024}, 4);
  checkpoints.checkpoint_offsets = kUnreadOffsets;
  expect_refused(forced, checkpoints, ErrorCode::kUnsupported, "checkpoints");
}

}  // namespace
}  // namespace flashkda
