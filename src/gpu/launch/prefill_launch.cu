// Host side of the CUDA prefill path: workspace layout, grid choice, launches. No device
// allocation and no host synchronisation happen here.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/fail.h"
#include "gpu/gpu_backend.h"
#include "gpu/launch/device_views.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/tensor_map.h"
#include "gpu/prefill/fused_config.h"
#include "gpu/prefill/kernels.h"

namespace flashkda::gpu {
namespace {

SequenceTable sequence_table(const Problem& p) {
  SequenceTable t;
  t.cu_seqlens = p.cu_seqlens;
  t.cu_seqlens_i32 = p.cu_seqlens_dtype == DType::kI32;
  t.fixed_len = p.T;
  t.num_seqs = p.N;
  t.total_tokens = p.total_tokens;
  return t;
}

// Multiprocessors of the current device, read once per device (forward's host time is GPU
// idle time for a caller who waits on it).
int multiprocessor_count() {
  static PerDevice<int> sms;
  return sms.get("reading the multiprocessor count of the current device", [](int& count) {
    int device = 0;
    const cudaError_t err = cudaGetDevice(&device);
    return err == cudaSuccess ? cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) : err;
  });
}

// State-pass layout. The pass is a chain of dependent chunk steps per (sequence, head), so it
// needs many warps in flight; but every extra block per head re-reads that head's chunk records.
// Take the first layout, from most to least economical in bytes, that puts a block on at least
// half the multiprocessors and two warps on each; few heads end at 1x4 (4x the warps of 8x1,
// each with a quarter of the per-step work).
StateConfig choose_state_config(int64_t seq_heads, int sms) {
  constexpr StateConfig kConfigs[] = {{8, 1}, {4, 1}, {2, 2}};
  for (const StateConfig& c : kConfigs) {
    const int64_t blocks = seq_heads * (8 / c.value_slices);
    if (2 * blocks >= sms && blocks * c.value_slices * c.key_parts >= 2 * sms) return c;
  }
  return {1, 4};
}

// FLASHKDA_STATE_CONFIG=VxK (8x1, 4x1, 2x2, 1x4) overrides the choice: tests run every layout.
StateConfig state_config(int64_t seq_heads, int sms) {
  if (const char* forced = std::getenv("FLASHKDA_STATE_CONFIG")) {
    StateConfig c{0, 0};
    if (std::sscanf(forced, "%dx%d", &c.value_slices, &c.key_parts) == 2) return c;
    fail(ErrorCode::kInvalidArgument, "FLASHKDA_STATE_CONFIG: expected VxK such as 2x2, got '", forced, "'");
  }
  return choose_state_config(seq_heads, sms);
}

// An on/off override of a launcher choice (tests force each path): "0" or "1", or unset (-1).
int forced_switch(const char* name) {
  const char* forced = std::getenv(name);
  if (!forced) return -1;
  if (forced[0] == '0' || forced[0] == '1') return forced[0] - '0';
  fail(ErrorCode::kInvalidArgument, name, ": expected 0 or 1, got '", forced, "'");
}

// Segment-parallel state pass (StateSplit in kernels.h): one sequence, few heads, long. The
// chain of T/16 steps is the whole cost there and most multiprocessors idle; cutting it into S
// segments runs 2S - 1 chains of T/(16 S) steps at once (segment 0, and each later segment from
// zero and from the identity) and the stitch kernel combines them. The runs go on the wgmma state
// kernel, a block a head and run, one a multiprocessor: ~1.3 us of a multiprocessor a chunk,
// where a 2x2 run (four blocks, two a multiprocessor) costs ~2.8. S is the largest count whose
// runs fit one wave, with segments of at least 3840 tokens (240 chunks), up to 17; below 3
// segments the stitch costs more than the chain saves. P8's 4 heads fit 17 (33 runs x 4 = 132
// blocks): 0.674 against 0.691 ms at S = 16 (5a69ee4, two runs each; S = 12: 0.777). Measured
// on the H200 at 443eb06 (ms, wgmma against the 2x2 runs the plan took before): P7 0.768
// against 1.072 (S = 8 against 4), P8 0.850 against 1.134 (S = 16 against 8; wgmma at S = 8:
// 1.10, S = 12: 0.92), P11 2.81 against 4.21 (8 against 4). FLASHKDA_SPLIT_LAYOUT=2x2|1x4 takes
// the mma.sync runs: 2x2 reads half the records of 1x4 per head, which matters once many runs
// share the L2; one block a multiprocessor with 6 stages, or two with 3 (compact) where that at
// least doubles S. Measured on the H200 (ae03dfd,
// ms, 1x4 / 2x2 at S = 2, 3, 4, 6, 8; unsplit P7 1.55, P8 2.92, P11 6.18):
//   P7  [32768] x 8:   1.80 1.94 1.87 1.96 2.04  /  1.60 1.56 1.39 1.71 1.56
//   P8  [65536] x 4:   2.46 2.35 1.98 2.40 2.02  /  2.72 2.08 1.77 1.72 1.54
//   P11 [131072] x 8:  6.77 7.31 7.06 7.25 7.40  /  6.21 5.85 5.07 6.18 5.42
// FLASHKDA_SPLIT=0/1 forces the pass off/on (on: any single sequence, S >= 2, for the tests);
// FLASHKDA_SPLIT_SEGMENTS=S forces the count (2..32) and FLASHKDA_SPLIT_LAYOUT=wgmma|1x4|2x2 the runs.
constexpr int64_t kSplitMinTokens = 3840;  // per segment
constexpr int kSplitMaxSegments = 17;
constexpr int kSplitMaxForcedSegments = 32;  // FLASHKDA_SPLIT_SEGMENTS (measurements past the rule)

struct SplitChoice {
  int segments = 0;  // 0: not split
  bool compact = false;
  bool wgmma = true;  // the runs on the wgmma pass (layout unused), else on `layout`
  StateConfig layout{2, 2};
};

// The most segments whose 2S - 1 runs of `blocks` blocks fit `slots` block slots.
int segments_fitting(int64_t blocks, int64_t slots) { return static_cast<int>((slots / blocks + 1) / 2); }

SplitChoice choose_split(const Problem& p, StateConfig c, int sms) {
  // The stitch writes the final state where the host says, and a pool's slot is device data;
  // checkpoints are written by the chain that holds the state at their chunk boundary; the stitch
// writes V-major states.
  if (p.N != 1 || p.state_indices || p.checkpoint_offsets || p.state_layout != StateLayout::kVK) return {};
  const int forced = forced_switch("FLASHKDA_SPLIT");
  if (forced == 0) return {};
  SplitChoice choice;
  if (const char* layout = std::getenv("FLASHKDA_SPLIT_LAYOUT"); layout && std::strcmp(layout, "wgmma") != 0) {
    StateConfig& l = choice.layout;
    if (std::sscanf(layout, "%dx%d", &l.value_slices, &l.key_parts) != 2 ||
        !((l.value_slices == 1 && l.key_parts == 4) || (l.value_slices == 2 && l.key_parts == 2)))
      fail(ErrorCode::kInvalidArgument, "FLASHKDA_SPLIT_LAYOUT: expected wgmma, 1x4 or 2x2, got '", layout, "'");
    choice.wgmma = false;
  }
  // Blocks of one run: a head a block on wgmma (one a multiprocessor: its 6 stages fill shared
  // memory), else the layout's blocks a head.
  const int64_t blocks = choice.wgmma ? p.H : p.H * (8 / choice.layout.value_slices);
  const int wide = segments_fitting(blocks, sms);
  const int compact = choice.wgmma ? 0 : segments_fitting(blocks, 2 * int64_t{sms});
  if (const char* n = std::getenv("FLASHKDA_SPLIT_SEGMENTS")) {
    if (std::sscanf(n, "%d", &choice.segments) != 1 || choice.segments < 2 ||
        choice.segments > kSplitMaxForcedSegments)
      fail(ErrorCode::kInvalidArgument, "FLASHKDA_SPLIT_SEGMENTS: expected 2 to ", kSplitMaxForcedSegments,
           ", got '", n, "'");
    choice.compact = !choice.wgmma && choice.segments > wide;
    return choice;
  }
  if (forced != 1 && (c.value_slices != 1 || c.key_parts != 4)) return {};  // many heads fill the GPU already
  choice.compact = compact >= 2 * wide;
  const int64_t by_length = std::min<int64_t>(kSplitMaxSegments, p.total_tokens / kSplitMinTokens);
  choice.segments = static_cast<int>(std::min<int64_t>(choice.compact ? compact : wide, by_length));
  if (forced == 1) choice.segments = std::max(choice.segments, 2);
  else if (choice.segments < 3) return {};
  return choice;
}

// Persistent state pass (state_persistent_kernel.cu): with more (sequence, head) items than
// multiprocessors, one block per multiprocessor taking items from a counter keeps its pipeline
// full across items, where a block per item starts empty and loads its state. Measured faster
// on every case with at least 2x the items (P2, P3, P5, P6, P9: 384 to 2048 items); taken there
// with the 8x1 layout. FLASHKDA_PERSISTENT=0/1 forces it off/on (on: any problem with tokens
// that the split pass does not take, for the tests).
bool use_persistent(const Problem& p, StateConfig c, int sms) {
  if (p.total_tokens == 0) return false;  // the prep kernel, which zeroes the item counter, does not run
  if (p.state_layout != StateLayout::kVK) return false;  // it stages V-major rows of the initial state
  if (p.initial_slots * p.H > INT32_MAX) return false;     // through a tensor map: int32 (slot, head) coordinates
  if (const int forced = forced_switch("FLASHKDA_PERSISTENT"); forced >= 0) return forced == 1;
  return c.value_slices == 8 && c.key_parts == 1 && p.N * p.H >= 2 * sms;
}

// The prep tail's workspace: its chunk counter, multiprocessor count and count of records written
// on a 128-byte line, the per-multiprocessor block counts and ranks, then a ready flag per record.
constexpr size_t kTailCounterBytes = 128;
constexpr size_t kTailSmBytes = kMaxSmIds * sizeof(unsigned);
// Tail blocks a multiprocessor: the prep kernel's own occupancy (80 registers, 35 KB: six), which
// it needs for its rate (perf-notes: 1581 / 970 / 787 / 648 / 538 us at P1 with 1 / 2 / 3 / 4 / 6).
// The grid is six times the multiprocessors; with the softplus gate (96 registers: five fit) the
// blocks that do not fit at first start on the multiprocessors the others left, and leave too.
constexpr int kTailBlocksPerSm = 6;

// The prep tail's chunks (TailChunks in prefill/tail_chunks.h; one sequence) as the plan cut them.
TailChunks tail_chunks(const Problem& p, const PrefillPlan& plan) {
  if (plan.tail_sms == 0) return {};
  const int chunks = static_cast<int>((p.total_tokens + kChunk - 1) / kChunk);  // < 2^27 (check_limits)
  const int segments = plan.pass == PrefillPlan::Pass::kSplit ? plan.split_segments : 1;
  return {chunks, (chunks + segments - 1) / segments, plan.tail_per_segment, segments};  // StateSplit's segments
}

// The prep tail's hand-off in its workspace region (plan.tail_bytes, zeroed before each call),
// laid out as the constants above say; none (ready = nullptr) without a tail.
PrepTail tail_hand_off(uint8_t* region, const Problem& p, const PrefillPlan& plan) {
  if (plan.tail_sms == 0) return {};
  return {tail_chunks(p, plan),
          reinterpret_cast<unsigned long long*>(region),
          reinterpret_cast<unsigned*>(region + sizeof(unsigned long long)),
          reinterpret_cast<unsigned*>(region + kTailCounterBytes),
          reinterpret_cast<uint32_t*>(region + kTailCounterBytes + kTailSmBytes),
          reinterpret_cast<uint32_t*>(region + kTailCounterBytes + 2 * kTailSmBytes),
          reinterpret_cast<unsigned*>(region + sizeof(unsigned long long) + sizeof(unsigned)),
          plan.tail_sms,
          kTailBlocksPerSm};
}

// The persistent pass's item counter: one 8-byte counter on a 128-byte line of its own, then
// (orders_sequences) the sequence order, [N] int32.
constexpr size_t kItemCounterBytes = 128;

// Whether the persistent pass takes sequences longest first (sequences.cuh): several of them, of
// lengths that can differ (FLASHKDA_SEQ_ORDER=0 keeps the order 0, 1, ..., for comparison).
bool orders_sequences(const Problem& p) {
  return p.cu_seqlens && p.N > 1 && p.N <= kMaxOrderedSeqs && forced_switch("FLASHKDA_SEQ_ORDER") != 0;
}

// Prep tail: one sequence on many heads (P1) runs the 8x1 pass with one block a head, H of the
// multiprocessors, and leaves the others idle for the whole chain (P1: 36 of 132 for ~670 us);
// the wgmma split pass of one long sequence on few heads runs (2S - 1) H blocks (P7, P11: 120,
// 12 idle for ~340 / 1330 us). The prep kernel then writes only the chunks the chains need first,
// and a second prep grid (the tail, PrepTail in kernels.h) writes the rest on the idle
// multiprocessors while the chains run: the last chunks of the sequence, or of each segment
// (TailChunks). It is launched before the state grid, its blocks stay on the idle number of
// multiprocessors and leave the others at once, and the state grid, launched after it
// programmatically, starts on the empty ones and waits for the tail's records (the 8x1 pass a
// ready flag each, the split pass once a run for all). Neither grid waits on one that can be
// kept from running: the tail's blocks never wait on the state pass, and where the runtime does
// not overlap them (profilers, sanitizers) the state grid finds every record written. The tail's
// share keeps it ahead of the chains: on I idle multiprocessors it writes one chunk of each of
// the S segments of all H heads in ~r S H / I us (r: the prep kernel's time a record on a
// multiprocessor at six blocks) against a chain step of ~t us. The 8x1 pass (S = 1) waits a
// record at a time, so up to (t / r) I / H of the chunks: r ~1.41 us (P1's 49152 records in
// ~524 us on 132), t ~1.31, so 0.93 I / H; 0.84 I / H leaves a 10% margin (P1: 31%). The
// softplus gate's prep is ~1.22x slower (P1: 0.670 against 0.549 ms, ncu), so its share is
// smaller: 0.67 I / H. Measured on the H200 at 5253f3c with the share forced (two runs each): P1
// 1.055 at 0.315 (the default), 1.073 at 0.28, 1.053 at 0.34, 1.089 at 0.37; P1-softplus 1.287 at
// 0.315, 1.222 at 0.28, 1.336 at 0.34, 1.391 at 0.37; at 9fc21db and 4830f2c (machines of two
// calls): 1.218 / 1.222 at 0.281, 1.168 / 1.172 at 0.25, 1.177 at 0.26, 1.190 at 0.22 (a call of
// 0.20 / 0.22 / 0.25 alone read 1.21 / 1.20 / 1.21). This rule gives 0.251 at P1. The split
// pass's runs wait once for the whole tail, when they reach their segments' tails (a wait a
// record cost them 15%: state_wgmma_kernel.cu), so the tail must be done by then: a share f with
// f r S H / I <= (1 - f) t, f <= x / (1 + x) for x = (t / r) I / (S H), of which 0.9 is kept.
// Measured rates (ncu at a9fce7c, P7): the tail's wgmma records r ~1.41 us (2392 in 281 us on 12
// multiprocessors), the chain step t ~1.33 (256 steps in 340 us): t / r = 0.94 (softplus, its
// prep 1.22x slower: 0.77); P7, P11: x = 0.176, f = 0.135. Measured against forced shares at
// cd2ebb2 (two runs each): P7 0.653 at 0.135, 0.659 at 0.10, 0.707 at 0.17, 0.772 at 0.20; P11
// 2.402 / 2.422 at 0.135, 2.425 / 2.507 at 0.10, 2.61 at 0.17 (a larger tail is not done when
// the runs reach it, and they wait). FLASHKDA_PREP_TAIL=0 turns it off;
// FLASHKDA_PREP_TAIL_SHARE=x sets the share (tests, measurements).
constexpr int kMinTailSms = 8;
constexpr int64_t kMinTailChunks = 64;
constexpr double kTailShareSafe = 0.84, kTailShareSoftplus = 0.67;  // 8x1: times I / H
constexpr double kTailRateSplitSafe = 0.94, kTailRateSplitSoftplus = 0.77;  // split: t / r
constexpr double kTailSplitMargin = 0.9;

void plan_tail(const Problem& p, StateConfig c, PrefillPlan& plan) {
  const bool split = plan.pass == PrefillPlan::Pass::kSplit && plan.split_wgmma;  // N = 1, V-major, no checkpoints
  const bool per_item = plan.pass == PrefillPlan::Pass::kPerItem && c.value_slices == 8 && p.N == 1 &&
                        !p.checkpoint_offsets && p.state_layout == StateLayout::kVK;
  if (!(split || per_item) || forced_switch("FLASHKDA_PREP_TAIL") == 0) return;
  const int segments = split ? plan.split_segments : 1;
  const int64_t blocks = p.H * (split ? 2 * segments - 1 : 1);  // a block a head (and run) a multiprocessor
  const int64_t idle = plan.multiprocessors - blocks;
  const int64_t chunks = (p.total_tokens + kChunk - 1) / kChunk;
  if (idle < kMinTailSms || chunks < kMinTailChunks) return;
  const bool softplus = p.gate == Gate::kSoftplus;
  const double per_record = static_cast<double>(idle) / static_cast<double>(segments * p.H);  // I / (S H)
  double share = (softplus ? kTailShareSoftplus : kTailShareSafe) * per_record;
  if (split) {
    const double x = (softplus ? kTailRateSplitSoftplus : kTailRateSplitSafe) * per_record;
    share = kTailSplitMargin * x / (1.0 + x);
  }
  share = std::min(share, 0.5);
  if (const char* forced = std::getenv("FLASHKDA_PREP_TAIL_SHARE")) {  // not capped: measurements past 0.5
    if (std::sscanf(forced, "%lf", &share) != 1 || !(share > 0.0 && share < 1.0))
      fail(ErrorCode::kInvalidArgument, "FLASHKDA_PREP_TAIL_SHARE: expected a fraction in (0, 1), got '", forced, "'");
  }
  // Of each segment's chunks, and never more than the last (shortest) segment holds.
  const int64_t per = (chunks + segments - 1) / segments, last = chunks - (segments - 1) * per;
  const int64_t per_segment = std::min(static_cast<int64_t>(share * static_cast<double>(per)), last);
  if (per_segment < 1) return;
  plan.tail_per_segment = static_cast<int>(per_segment);
  plan.tail_sms = static_cast<int>(idle);
  plan.tail_bytes = kTailCounterBytes + 2 * kTailSmBytes +
                    static_cast<size_t>(num_chunk_slots(p.total_tokens, p.N) * p.H) * sizeof(uint32_t);
}

// Whether the state grid starts programmatically after the prep grid (StateParams::after_prep):
// its launch and set-up then overlap the prep grid's last blocks. Measured on the H200 (same
// binary, two runs each, FLASHKDA_STATE_PDL=0 against 1): P7 1.136 -> 1.126, P8 1.216 -> 1.204,
// P9 0.3805 -> 0.3783, P3, P5, P6 -0.2 to -0.35%, P2 unchanged. Not where a layout of two blocks a
// multiprocessor has fewer blocks than multiprocessors (4x1 at P4, P10: 128 blocks): a plain
// launch gives each block a multiprocessor of its own, while blocks that start as the prep grid
// drains pack two a multiprocessor onto the first ones it frees (P4 0.727 -> 0.734, P10 1.456
// -> 1.478). Not with a prep tail either: that state grid follows the tail's grid (kTail).
bool starts_after_prep(const Problem& p, const PrefillPlan& plan) {
  if (p.total_tokens == 0 || plan.tail_sms > 0 || forced_switch("FLASHKDA_STATE_PDL") == 0) return false;
  if (plan.pass != PrefillPlan::Pass::kPerItem) return true;
  const bool two_a_multiprocessor = plan.value_slices == 4 || plan.value_slices == 2;  // launch_state: 4x1, 2x2
  return !two_a_multiprocessor || p.N * p.H * (8 / plan.value_slices) > plan.multiprocessors;
}

// The experimental wgmma state pass (state_wgmma_kernel.cu): only when FLASHKDA_STATE_WGMMA=1
// forces it, and only where it applies (V-major states, no checkpoints); nothing chooses it yet.
bool use_wgmma(const Problem& p) {
  return forced_switch("FLASHKDA_STATE_WGMMA") == 1 && p.state_layout == StateLayout::kVK && !p.checkpoint_offsets;
}

// The fp16 step (state_step_f16.cuh; docs/perf-notes.md, "fp16 as the state step's MMA type"):
// the persistent pass and the 8x1 and 4x1 per-item passes, with checkpoints and K-major states too.
// Measured at 350167e (one H100, two runs each, FLASHKDA_STATE_F16=0 against the default): P2
// 1.187 -> 1.015, P6 0.800 -> 0.680, P1-ckpt 1.336 -> 1.105; the 4x1 layout was slower then (P4
// 0.796 -> 0.825) until b15ea70 took the branches out of its v loads: forced there at b15ea70, P4
// 0.803 -> 0.708, P10 1.623 -> 1.400 (one H100, two runs each). The split pass keeps its own
// (wgmma or tf32 mma.sync). FLASHKDA_STATE_F16=0: the tf32 step everywhere (A/B).
bool use_f16_step(const PrefillPlan& plan, StateConfig c) {
  if (forced_switch("FLASHKDA_STATE_F16") == 0) return false;
  if (plan.pass == PrefillPlan::Pass::kPersistent) return true;
  return plan.pass == PrefillPlan::Pass::kPerItem && c.key_parts == 1 && (c.value_slices == 8 || c.value_slices == 4);
}

// What the fused chunk-64 prefill (fused_kernel.cu) cannot take yet, by name; nullptr if nothing.
const char* fused_prefill_lacks(const Problem& p) {
  if (p.gate != Gate::kSafe) return "the softplus gate";
  if (p.state_layout != StateLayout::kVK) return "K-major states";
  if (p.state_indices || p.final_state_indices) return "state pools";
  if (p.checkpoint_offsets) return "checkpoints";
  return nullptr;
}

// The fused prefill where it applies and was measured faster than the two-kernel path. It runs a
// block a (sequence, head) for the item's whole chain, so it needs items for about 70% of the
// multiprocessors or more, and sequences of kFusedMinMeanTokens on average (a block's start, its
// first chunk's prep with no step beside it, and its state's load and store are paid once a
// sequence). At 18cc302 on one H100 (bench --batch B --seqlen T --heads H, fused forced against
// the two-kernel path, same call): 64 x 64 tokens x 32 heads +57%, 128 x 128 x 8 +18%, P9 (64 x
// 128 x 32) +28%; 32 x 256 x 32 -3.4%, 16 x 512 x 32 -20%, 8 x 512 x 96 -19%. (The threshold was
// 1024 when the kernel was ~3x slower.) Earlier, on one H100 against the two-kernel path
// (docs/perf-notes.md, "The fused prefill by default" and "Out rows by bulk store, tiles by
// HMUL2"): P2 -10.8%, P3 -10%, P5 -8.7%, P6 -12% at 98ca4eb; P1 (96 items on 132: 73%) -5.4%
// at 4008add in one call, even before 41d0c98. The fused time of one wave does not shrink with
// fewer items while the two-kernel path's does, so at P1's margin the crossover is near 92 items
// on 132 (70%); at 98ca4eb P4 and P10 (64 items) and P7, P8 and P11 (4 to 8) were 36% to 9x slower.
// FLASHKDA_FUSED=1 forces it (refusing by name what it lacks), =0 keeps the two-kernel path.
constexpr int64_t kFusedMinMeanTokens = 256;
constexpr int64_t kFusedMinItemsPercentOfSMs = 70;
// Two blocks an item (FusedParams::pair) where the pairs fit one wave, on long sequences (16 chunks
// a block or more on average): each block prepares every other chunk while the other steps. By
// default only where the pairs fill 70% of the multiprocessors (P4, P10: 64 items on 132; one H100,
// two runs: with the state handed over, P4 0.624-0.630 ms against the two-kernel path's
// 0.647-0.650, P10 1.226 against 1.275-1.283, the one-block form 0.795 / 1.571; docs/perf-notes.md,
// "The pair form for P4 and P10"; with the update handed over instead, at 0b9c88e, P4 0.573-0.577
// against 0.630-0.633, P10 1.131-1.132 against 1.237-1.246); forced fused prefills take them
// wherever they fit.
constexpr int64_t kFusedPairMinMeanTokens = 2048;
bool pairs_fit(const Problem& p, int sms) { return 2 * p.N * p.H <= sms && p.total_tokens >= kFusedPairMinMeanTokens * p.N; }
bool pairs_fill(const Problem& p, int sms) {
  return pairs_fit(p, sms) && 100 * 2 * p.N * p.H >= kFusedMinItemsPercentOfSMs * int64_t{sms} && forced_switch("FLASHKDA_FUSED_PAIR") != 0;
}
// The split pass's runs on the fused prefill (FusedParams::split_runs) wherever the wgmma runs would
// take it and the fused prefill applies: each run prepares its own chunks of 64 tokens beside its
// chain, where the wgmma runs read the prep kernel's records of 16 tokens (no prep kernel, no
// records, a 64-token step). One H100, two runs each, at 0b9c88e: P7 0.606 ms against 0.718, P8
// 0.613 against 0.746, P11 2.237 against 2.642. FLASHKDA_SPLIT_FUSED=0 keeps the wgmma runs (the
// softplus gate takes them).
bool use_split_fused(const Problem& p) {
  const int forced = forced_switch("FLASHKDA_SPLIT_FUSED");
  if (forced == 0) return false;
  const char* lacks = fused_prefill_lacks(p);
  if (forced == 1 && lacks)
    fail(ErrorCode::kUnsupported, "FLASHKDA_SPLIT_FUSED=1: the fused prefill does not take ", lacks, " yet; unset it");
  return !lacks;
}

bool use_fused(const Problem& p, int sms) {
  const int forced = forced_switch("FLASHKDA_FUSED");
  if (forced == 0) return false;
  const char* lacks = fused_prefill_lacks(p);
  if (forced == 1) {
    if (lacks) fail(ErrorCode::kUnsupported, "FLASHKDA_FUSED=1: the fused prefill does not take ", lacks, " yet; unset it");
    return true;
  }
  const int64_t items = p.N * p.H;
  return !lacks && items <= INT32_MAX && p.total_tokens >= kFusedMinMeanTokens * p.N &&
         (100 * items >= kFusedMinItemsPercentOfSMs * int64_t{sms} || pairs_fill(p, sms));
}

// What the kernels can index: token rows are int32 tensor-map coordinates, heads grid.y.
void check_limits(const Problem& p) {
  if (p.total_tokens > INT32_MAX)
    fail(ErrorCode::kUnsupported, "q: the CUDA path takes at most 2^31 - 1 tokens (B * T), got ", p.total_tokens);
  if (p.H > 65535) fail(ErrorCode::kUnsupported, "q: the CUDA path takes at most 65535 heads, got H = ", p.H);
}

}  // namespace

PrefillPlan plan_prefill(const Problem& p) { return plan_prefill(p, multiprocessor_count()); }

PrefillPlan plan_prefill(const Problem& p, int multiprocessors) {
  if (p.K != kHeadDim || p.V != kHeadDim)
    fail(ErrorCode::kUnsupported, "the CUDA path implements K = V = 128 only, got K = ", p.K, ", V = ", p.V);
  check_limits(p);
  PrefillPlan plan;
  plan.multiprocessors = multiprocessors;
  StateConfig c = state_config(p.N * p.H, plan.multiprocessors);
  const int64_t slots = num_chunk_slots(p.total_tokens, p.N);
  if (use_fused(p, plan.multiprocessors)) {  // no workspace
    plan.pass = PrefillPlan::Pass::kFused;
    if (const char* forced = std::getenv("FLASHKDA_FUSED_SPLIT")) {
      int a = 0, b = 0;
      if (std::sscanf(forced, "%d:%d", &a, &b) != 2 || !fused::valid_split(a, b))
        fail(ErrorCode::kInvalidArgument, "FLASHKDA_FUSED_SPLIT: expected a:b with 0 < a < b < ", fused::kChannelGroups,
             ", got '", forced, "'");
      plan.fused_split[0] = a, plan.fused_split[1] = b;
    }
    plan.fused_longest_first = p.cu_seqlens && p.N > 1 && p.N <= fused::kMaxLongestFirstSeqs && forced_switch("FLASHKDA_SEQ_ORDER") != 0;
    const int pair = forced_switch("FLASHKDA_FUSED_PAIR");
    plan.fused_pair = pair == 1 || (pair != 0 && pairs_fit(p, plan.multiprocessors));
    // The L2 prefetch measured no better (H100: P4 0.630-0.635 against 0.624-0.630 without, P10
    // 1.242-1.243 against 1.226): off unless FLASHKDA_FUSED_PAIR_PREFETCH=1.
    plan.fused_pair_prefetch = forced_switch("FLASHKDA_FUSED_PAIR_PREFETCH") == 1;
    return plan;
  }
  if (use_wgmma(p)) {
    plan.pass = PrefillPlan::Pass::kWgmma;
    plan.record_bytes = static_cast<size_t>(slots * p.H) * WgmmaRecord::kBytes;
    return plan;
  }
  if (const SplitChoice split = choose_split(p, c, plan.multiprocessors); split.segments > 0) {
    plan.pass = PrefillPlan::Pass::kSplit;
    plan.split_segments = split.segments;
    plan.split_compact = split.compact;
    plan.split_wgmma = split.wgmma;
    plan.split_fused = split.wgmma && use_split_fused(p);
    // A segment's two runs sharing their chunks' prep (docs/perf-notes.md, "What to try next"): built
    // and compiled clean, not yet run on a GPU, so opt-in. 2 S H blocks: S as many as fit one wave
    // (one fewer run than there are blocks: segment 0's second block runs a spare A run).
    plan.split_shared = plan.split_fused && forced_switch("FLASHKDA_SPLIT_SHARED") == 1;
    if (plan.split_shared && !std::getenv("FLASHKDA_SPLIT_SEGMENTS"))
      plan.split_segments = std::max(2, std::min(plan.split_segments, static_cast<int>(plan.multiprocessors / (2 * p.H))));
    c = split.layout;
  } else if (use_persistent(p, c, plan.multiprocessors)) {
    plan.pass = PrefillPlan::Pass::kPersistent;
    c = {8, 1};
  }
  plan.value_slices = c.value_slices;
  plan.key_parts = c.key_parts;
  if (const char* forced = std::getenv("FLASHKDA_PREP_BLOCKS_PER_SM")) {
    if (std::sscanf(forced, "%d", &plan.prep_blocks_per_sm) != 1 || plan.prep_blocks_per_sm < 1 ||
        plan.prep_blocks_per_sm > 6)
      fail(ErrorCode::kInvalidArgument, "FLASHKDA_PREP_BLOCKS_PER_SM: expected 1 to 6, got '", forced, "'");
  }

  plan.state_f16 = use_f16_step(plan, c);
  plan.record_bytes = plan.split_fused ? 0 : static_cast<size_t>(slots * p.H) * record_bytes(plan.records());
  if (!plan.split_fused) {  // the fused runs have no prep kernel
    plan_tail(p, c, plan);
    plan.state_after_prep = starts_after_prep(p, plan);
  }
  // Both measured at 5bb0a1e (perf-notes, versions table): P7 -3.1%, P8 -3.9%, P11 -1.3%; =0 keeps
  // the launch-a-step chain and the tile-a-block rows for A/B.
  plan.stitch_chain_launch = forced_switch("FLASHKDA_STITCH_CHAIN") != 0;
  plan.stitch_rows_kept = forced_switch("FLASHKDA_STITCH_ROWS") != 0;
  plan.stitch_rows_3xtf32 = forced_switch("FLASHKDA_STITCH_3XTF32") == 1;
  plan.stitch_rows_wgmma = forced_switch("FLASHKDA_STITCH_ROWS_WGMMA") != 0;
  if (plan.pass == PrefillPlan::Pass::kSplit) {
    plan.split_state_bytes = static_cast<size_t>(p.H) * kHeadDim * kHeadDim * sizeof(float);
    plan.split_row_bytes = static_cast<size_t>(p.total_tokens * p.H) * kHeadDim * sizeof(float);
  } else if (plan.pass == PrefillPlan::Pass::kPersistent) {
    plan.counter_bytes = kItemCounterBytes;
    if (orders_sequences(p)) plan.counter_bytes += static_cast<size_t>(p.N) * sizeof(int);
  }
  return plan;
}

// The fused prefill's launch: q, k, g, v and out as tensor maps of [64 tokens][64] swizzled boxes.
void fused_forward(const Problem& p, const PrefillPlan& plan, cudaStream_t stream, const StateSplit& split = {}) {
  auto tiles = [&](const uint16_t* data, const RowStrides& rows) {
    const ActivationView a = activation_view(data, rows, p, kHeadDim);  // token rows evenly spaced (the plan)
    return encode_token_tiles_map(data, p.total_tokens, p.H, a.token, a.head, fused::kC);
  };
  const CUtensorMap out_tiles = encode_token_tiles_map(p.out, p.total_tokens, p.H, p.H * kHeadDim, kHeadDim, fused::kC);  // dense
  FusedParams f{tiles(p.q, p.q_rows), tiles(p.k, p.k_rows), tiles(p.g, p.g_rows), tiles(p.v, p.v_rows), out_tiles,
                activation_view(p.beta, p.beta_rows, p, 1), p.A_log, p.dt_bias, p.lower_bound, p.scale,
                static_cast<int>(p.H), sequence_table(p), p.initial_state, p.initial_state_dtype == DType::kF32,
                p.final_state, p.final_state_dtype == DType::kF32, p.out, {plan.fused_split[0], plan.fused_split[1]},
                plan.fused_longest_first, plan.fused_pair, plan.fused_pair_prefetch, split, plan.split_shared};
  launch_fused(f, stream);
}

namespace {

// The split pass's fp32 buffers after the records, in PrefillPlan::workspace_bytes' order: S_s^T at
// the ends of segments 0 .. S-2, B_s^T and A_s^T of segments 1 .. S-1, then the out_b and out_a rows.
StateSplit split_buffers(const PrefillPlan& plan, uint8_t* after_records) {
  const int S = plan.split_segments;
  auto* buffers = reinterpret_cast<float*>(after_records);
  const int64_t state_elems = static_cast<int64_t>(plan.split_state_bytes / sizeof(float));
  const int64_t row_elems = static_cast<int64_t>(plan.split_row_bytes / sizeof(float));
  float* const boundary = buffers;
  float* const b_t = boundary + (S - 1) * state_elems;
  float* const a_t = b_t + (S - 1) * state_elems;
  float* const out_b = a_t + (S - 1) * state_elems;
  return {S, plan.split_compact, boundary, b_t, a_t, out_b, out_b + row_elems};
}

// The split pass (N = 1) after its 2S - 1 runs: the segment states chained (S_s = A_s S_{s-1} + B_s,
// the last into the final state), then the out rows of segments 1 .. S-1 stitched in one launch.
// `segment_chunk`: the tokens a chunk of the runs' segments (StateSplit::segment_tokens).
void stitch_split(const Problem& p, const PrefillPlan& plan, const StateSplit& split, const SequenceTable& seqs, int segment_chunk,
                  cudaStream_t stream) {
  const int S = plan.split_segments;
  const int64_t state_elems = static_cast<int64_t>(plan.split_state_bytes / sizeof(float));
  float* const boundary = split.boundary;
  const float* const a_t = split.a_t;
  const float* const b_t = split.b_t;
  const int H = static_cast<int>(p.H);
  constexpr int64_t kStateHead = int64_t{kHeadDim} * kHeadDim;
  const int chain_steps = p.final_state ? S - 1 : S - 2;
  if (plan.stitch_chain_launch) {
    const StitchChain chain{boundary, a_t, b_t, p.final_state, p.final_state_dtype == DType::kF32, S, chain_steps,
                            state_elems};
    if (chain_steps > 0) launch_stitch_chain(chain, H, stream);
  } else {
    for (int s = 1; s <= chain_steps; ++s) {  // one launch a step
      const bool last = s == S - 1;
      StitchParams chain{boundary + (s - 1) * state_elems, a_t + (s - 1) * state_elems, b_t + (s - 1) * state_elems,
                         last ? p.final_state : static_cast<void*>(boundary + s * state_elems),
                         last ? p.final_state_dtype == DType::kF32 : true, false, kHeadDim, kHeadDim, kStateHead,
                         kStateHead, 0, S, 0, seqs};
      launch_stitch(chain, H, stream);
    }
  }
  if (p.total_tokens > 0) {
    // Rows of one segment: at most ceil(chunks / S) chunks (bos = 0 once cu_seqlens is checked;
    // the kernel clamps to the real bounds either way).
    const int64_t chunks = (p.total_tokens + segment_chunk - 1) / segment_chunk;
    const int64_t segment_rows = (chunks + S - 1) / S * segment_chunk;
    StitchParams rows{split.out_a, boundary, split.out_b, p.out, false, true, segment_rows, p.H * kHeadDim,
                      kHeadDim, kStateHead, 1, S, state_elems, seqs, plan.stitch_rows_3xtf32};
    rows.segment_chunk = segment_chunk;
    if (plan.stitch_rows_kept) {
      auto tiles_of = [&](const float* rows_f32) {  // [total, H, 128] fp32, the rows kernel's boxes
        return encode_token_rows_map(rows_f32, p.total_tokens, p.H, p.H * kHeadDim, kHeadDim, kStitchRowTile,
                                     kStitchRowStride, true);
      };
      rows.x_rows = tiles_of(rows.x);
      rows.z_rows = tiles_of(rows.z);
      rows.rows_wgmma = plan.stitch_rows_wgmma;
      launch_stitch_rows(rows, H, plan.multiprocessors, stream);
    } else {
      launch_stitch(rows, H, stream, S - 1);
    }
  }
}

}  // namespace

void prefill_forward(const Problem& p, const PrefillPlan& plan, void* workspace, cudaStream_t stream) {
  if (p.N == 0) return;
  if (plan.pass == PrefillPlan::Pass::kFused) {
    fused_forward(p, plan, stream);
    return;
  }
  if (plan.split_fused) {  // the runs prepare their own chunks: no records
    const StateSplit split = split_buffers(plan, static_cast<uint8_t*>(workspace));
    fused_forward(p, plan, stream, split);
    stitch_split(p, plan, split, sequence_table(p), fused::kC, stream);
    return;
  }

  const SequenceTable seqs = sequence_table(p);
  auto* records = static_cast<uint8_t*>(workspace);
  auto* after_records = records + plan.record_bytes;  // 128-byte aligned: kBytes % 128 == 0
  const bool persistent = plan.pass == PrefillPlan::Pass::kPersistent;
  // The persistent pass's counter and sequence order, both written by the prep kernel.
  auto* counter = persistent ? reinterpret_cast<unsigned long long*>(after_records) : nullptr;
  int* order = persistent && plan.counter_bytes > kItemCounterBytes
                   ? reinterpret_cast<int*>(after_records + kItemCounterBytes)
                   : nullptr;
  // The prep tail's hand-off; its ready flags are written by the tail's grid and read by the state grid.
  auto* const tail_region = static_cast<uint8_t*>(workspace) + plan.tail_offset();
  const PrepTail tail = tail_hand_off(tail_region, p, plan);
  if (p.total_tokens > 0) {
    const ActivationView q = activation_view(p.q, p.q_rows, p, p.K), k = activation_view(p.k, p.k_rows, p, p.K),
                         g = activation_view(p.g, p.g_rows, p, p.K);
    PrepParams prep{q, k, g, q.same_strides(k) && q.same_strides(g), activation_view(p.beta, p.beta_rows, p, 1), p.A_log, p.dt_bias,
                    p.lower_bound, p.gate == Gate::kSoftplus, p.scale, static_cast<int>(p.H), seqs, records, counter};
    prep.record_form = plan.records();
    prep.seq_order = order;
    prep.blocks_per_sm = plan.prep_blocks_per_sm;
    if (plan.tail_sms > 0) {  // the chunks before the tail's, then the tail's grid (zeroed hand-off first)
      const cudaError_t err = cudaMemsetAsync(tail_region, 0, plan.tail_bytes, stream);
      if (err != cudaSuccess) fail(ErrorCode::kCudaError, "zeroing the prep tail's hand-off failed: ", cudaGetErrorString(err));
      prep.tail = tail;
      launch_prep(prep, tail.chunks.chunks - tail.chunks.count(), stream);
      launch_prep_tail(prep, kTailBlocksPerSm * plan.multiprocessors, stream);
    } else {
      launch_prep(prep, num_chunk_slots(p.total_tokens, p.N), stream);
    }
  }
  const ActivationView v = activation_view(p.v, p.v_rows, p, p.V);  // token rows evenly spaced (the plan)
  StateParams state{encode_token_rows_map(p.v, p.total_tokens, p.H, v.token, v.head, kChunk, kVRowStride),
                    records,
                    static_cast<int>(p.H),
                    seqs,
                    p.initial_state,
                    p.initial_state_dtype == DType::kF32,
                    p.final_state,
                    p.final_state_dtype == DType::kF32,
                    state_slot_table(p),
                    checkpoint_table(p),
                    p.out};
  state.k_major = p.state_layout == StateLayout::kKV;
  state.after_prep = plan.state_after_prep;
  state.f16_records = plan.state_f16;
  if (plan.pass == PrefillPlan::Pass::kWgmma) {
    launch_state_wgmma(state, stream);
    return;
  }
  if (persistent) {  // the prep kernel above zeroed the counter and wrote the order
    state.item_counter = counter;
    state.seq_order = order;
    if (p.initial_state)
      state.initial_rows = encode_state_rows_map(p.initial_state, p.initial_state_dtype == DType::kF32, p.initial_slots * p.H);
    launch_state_persistent(state, plan.multiprocessors, stream);
    return;
  }
  const StateConfig config{plan.value_slices, plan.key_parts};
  state.ready = tail.ready;
  state.tail_done = tail.done;
  state.tail_chunks = tail.chunks;
  if (plan.pass == PrefillPlan::Pass::kPerItem) {
    launch_state(state, config, stream);
    return;
  }

  const StateSplit split = split_buffers(plan, after_records);
  state.split = split;
  if (plan.split_wgmma) launch_state_wgmma(state, stream);
  else launch_state(state, config, stream);
  stitch_split(p, plan, split, seqs, kChunk, stream);
}

}  // namespace flashkda::gpu
