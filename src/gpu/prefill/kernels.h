// Launch parameters of the prefill kernels (shared by the kernels and the host launch code).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gpu/common/activation_view.cuh"
#include "gpu/common/state_slots.cuh"
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/sequences.cuh"
#include "gpu/prefill/tail_chunks.h"

namespace flashkda::gpu {

// The prep tail (prefill_launch.cu, "Prep tail"): the records of the TailChunks written by a prep
// grid on the multiprocessors the state grid leaves idle, while the chains run. Zeroed (all of
// it) before the prep launches.
struct PrepTail {
  TailChunks chunks;                           // which (per_segment 0: no tail; the prep grid writes every chunk)
  unsigned long long* item_counter = nullptr;  // chunks taken
  unsigned* sm_count = nullptr;                // multiprocessors that took a tail block
  unsigned* sm_blocks = nullptr;               // [kMaxSmIds] tail blocks that landed on each
  uint32_t* sm_rank = nullptr;                 // [kMaxSmIds] 1 + its rank among them (0: not yet)
  uint32_t* ready = nullptr;                   // [num_slots, H] 1 once that record is written
  unsigned* done = nullptr;                    // records written (after their ready flags)
  int sms = 0;                                 // multiprocessors the tail keeps
  int blocks_per_sm = 0;                       // tail blocks each of them keeps
};
// %smid values the per-multiprocessor counts cover (H200: 132 multiprocessors); a block on a
// higher one leaves.
constexpr int kMaxSmIds = 256;

struct PrepParams {
  ActivationView q, k, g;  // [total, H, 128] bf16, any strides of 8 elements (16-byte loads)
  bool same_row_strides;   // q, k, g have the same strides: one row offset serves all three
  ActivationView beta;     // [total, H], any strides
  const float* A_log;    // [H]
  const float* dt_bias;  // [H, 128]
  float lower_bound;     // the safe gate's bound (unused by the softplus gate)
  bool softplus_gate;    // a = -exp(A_log) softplus(g + dt_bias); else the safe gate
  float scale;
  int num_heads;
  SequenceTable seqs;
  uint8_t* records;      // [slots, H, record_bytes(record_form)]
  unsigned long long* item_counter;  // zeroed by block (0, 0) for the persistent state pass, or nullptr
  int* seq_order = nullptr;          // [N] written by block (0, 0): sequences longest first (persistent pass)
  // 0: as many blocks a multiprocessor as fit (6); 1..5: shared memory padded so that at most
  // this many do (FLASHKDA_PREP_BLOCKS_PER_SM, an experiment: prep's throughput at the occupancy a
  // kernel sharing the multiprocessors with the state pass would leave it).
  int blocks_per_sm = 0;
  RecordForm record_form = RecordForm::kTf32;  // the records' layout (the state pass's: PrefillPlan::records)
  // The prep tail's chunks (the prep grid skips them) and, for launch_prep_tail, its hand-off.
  PrepTail tail;
};

// The segment-parallel state pass (all buffers fp32, in the workspace; see state_kernel.cu): a
// sequence's chunks are cut into `segments` equal runs. Segment 0 runs from the initial state;
// every later segment s runs twice, from zero (B_s) and from the identity with v = 0 (A_s).
// Each is linear in the state S_{s-1} where it starts, so afterwards, in order,
//   S_s = A_s S_{s-1} + B_s   and   out = out_b + out_a S_{s-1} on the rows of segment s.
struct StateSplit {
  int segments = 0;            // S >= 2; 0: the pass is not split
  bool compact = false;        // 3-stage blocks, two a multiprocessor (more runs in one wave)
  float* boundary = nullptr;   // [S - 1][N, H, 128 v, 128 k] S_s^T at the end of segments 0 .. S-2
  float* b_t = nullptr;        // [S - 1][N, H, 128, 128] B_s^T of segments 1 .. S-1
  float* a_t = nullptr;        // [S - 1][N, H, 128 j, 128 k] A_s^T (row j: A_s's column j)
  float* out_b = nullptr;      // [total, H, 128 v] rows of segments 1 .. S-1
  float* out_a = nullptr;      // [total, H, 128 j] rows of segments 1 .. S-1

  // Run r of the pass (blockIdx.y of the state kernels): 0 runs segment 0 from the initial state;
  // 2s - 1 runs segment s from zero (B_s), 2s from the identity with v = 0 (A_s).
  __host__ __device__ static int segment_of(int run) { return (run + 1) / 2; }
  __host__ __device__ static bool is_a_run(int run) { return run > 0 && run % 2 == 0; }
  // Where run r > 0 writes its fp32 partial out rows.
  __host__ __device__ float* run_out(int run) const { return is_a_run(run) ? out_a : out_b; }
  // Where run r writes its final state (state_elems: one [N, H, 128, 128] state, N = 1).
  __host__ __device__ float* run_final(int run, int64_t state_elems) const {
    return run == 0         ? boundary
           : is_a_run(run) ? a_t + (segment_of(run) - 1) * state_elems
                           : b_t + (segment_of(run) - 1) * state_elems;
  }

  // Chunks [begin, end) of segment s of a sequence of `chunks` chunks.
  __host__ __device__ static void segment_chunks(int chunks, int segments, int s, int& begin, int& end) {
    const int per = (chunks + segments - 1) / segments;
    begin = s * per < chunks ? s * per : chunks;
    end = begin + per < chunks ? begin + per : chunks;
  }
  // Tokens [begin, end) of segment s of a sequence [bos, eos) cut in chunks of `chunk` tokens (kChunk:
  // the state passes' runs; 64: the fused runs), begin <= end.
  __host__ __device__ static void segment_tokens(int64_t bos, int64_t eos, int segments, int s, int chunk, int64_t& begin, int64_t& end) {
    int c_begin, c_end;
    segment_chunks(static_cast<int>((eos - bos + chunk - 1) / chunk), segments, s, c_begin, c_end);
    end = bos + int64_t{c_end} * chunk < eos ? bos + int64_t{c_end} * chunk : eos;
    begin = bos + int64_t{c_begin} * chunk < end ? bos + int64_t{c_begin} * chunk : end;
  }
};

// A state-pass stage's v rows are kVRowStride elements apart: the tensor-map box is 8 elements
// wider than a row (they arrive as zeros, past the tensor's row). The steps read V^T fragments
// as single elements, lane (g, t) from token rows 2t, 2t + 1 and column g: with 128-element rows
// the four token rows of a load share their banks, a 4-way conflict on every v load (about 10%
// of the 8x1 pass's shared-memory wavefronts at P1, ncu); 136 puts them 8 banks apart.
constexpr int kVRowStride = kHeadDim + 8;
static_assert((kVRowStride * 2) % 16 == 0, "tensor-map box rows are multiples of 16 bytes");

struct StateParams {
  CUtensorMap v_rows;          // v [total, H, 128] bf16, boxes of 16 tokens of one head, kVRowStride wide
  const uint8_t* records;      // [slots, H, ChunkRecord::kBytes] (F16Record::kBytes with f16_records)
  int num_heads;
  SequenceTable seqs;
  const void* initial_state;   // [slots, H, 128, 128] or nullptr
  bool initial_state_f32;
  void* final_state;           // [slots, H, 128, 128] or nullptr
  bool final_state_f32;
  StateSlotTable slots;        // each sequence's slots (n without pools; not split with pools)
  CheckpointTable checkpoints; // fp32 V-major states at chunk boundaries (not split with them)
  uint16_t* out;               // [total, H, 128] bf16
  StateSplit split;
  unsigned long long* item_counter = nullptr;  // persistent pass: items handed out past the first grid's worth
  const int* seq_order = nullptr;  // persistent pass: the order sequences' items are taken in, or nullptr (0, 1, ..)
  // Persistent pass with an initial state: its [slots H][128][128] rows as tensor-map boxes
  // (encode_state_rows_map), two (bf16) or four (fp32) copies an item.
  CUtensorMap initial_rows;
  bool k_major = false;        // states and checkpoints [.., 128 k, 128 v] (the per-item pass only)
  // F16Records and the fp16 step (state_step_f16.cuh): the 8x1 and 4x1 per-item passes and the
  // persistent pass (PrefillPlan::state_f16).
  bool f16_records = false;
  // With a prep tail (PrepTail): the ready flags of the tail's records ([slots, H]), those of
  // tail_chunks, which the 8x1 per-item pass waits on one by one; nullptr: every record was
  // written before this grid. The wgmma split pass waits once a run instead, when it reaches its
  // segment's tail, for tail_done to count all the tail's records (tail_chunks.count() H).
  const uint32_t* ready = nullptr;
  const unsigned* tail_done = nullptr;
  TailChunks tail_chunks;
  // Launched programmatically right after the prep grid (launch_kernel, programmatic_launch.h):
  // the grid may start while the prep grid's last blocks run; what reads the records, the item
  // counter or the order waits for it first (griddepcontrol.wait, a no-op otherwise).
  bool after_prep = false;
};

// Y = Z + X M (or X M^T) for rows of per-head [rows, 128] X, Z, Y and a per-head [128, 128] M;
// fp32 but Y (bf16 or fp32). See stitch_kernel.cu.
struct StitchParams {
  const float* x;
  const float* m;
  const float* z;
  void* y;
  bool y_f32;
  bool m_transposed;
  int64_t rows;          // rows per head (segment > 0: an upper bound of one segment's rows)
  int64_t row_stride;    // elements between rows of X, Z, Y
  int64_t head_stride;   // elements between heads of X, Z, Y
  int64_t m_head_stride;
  // segment > 0: the rows of that segment of sequence 0 (the split pass runs N = 1), and M of
  // segment s at m + (s - 1) m_segment_stride; blockIdx.z adds to `segment`.
  int segment;
  int segments;
  int64_t m_segment_stride;
  SequenceTable seqs;
  // X split hi + lo as M is (3xTF32: about fp32's accuracy); false: X rounded to tf32 once
  // (2xTF32), for the out rows, whose X (out_a) only adds its own rounding, ~2^-12 relative, to
  // out (stitch_kernel.cu). The chain of segment states keeps the split.
  bool x_split = true;
  // launch_stitch_rows without x_split: the products on wgmma (X split, M rounded to tf32: the
  // same one rounding on the other operand), else on mma.sync (stitch_kernel.cu)
  bool rows_wgmma = false;
  // launch_stitch_rows: X and Z as tensor maps of [64 rows][kStitchRowStride] fp32 boxes of one
  // head (encode_token_rows_map; rows, not segments: the kernel keeps to the segment's rows).
  CUtensorMap x_rows{}, z_rows{};
  int segment_chunk = kChunk;  // segment > 0: tokens a chunk of the runs' segments (StateSplit::segment_tokens)
};
constexpr int kStitchRowTile = 64;         // the rows kernel's tiles: rows of one head
constexpr int kStitchRowStride = 128 + 8;  // the rows kernel's X and Z rows in shared memory (fp32)

// The chain of the split pass's segment states in one launch (stitch_kernel.cu):
//   S_s^T = B_s^T + S_{s-1}^T A_s^T   for s = 1 .. steps, from S_0^T in boundary,
// S_1^T .. S_{S-2}^T into boundary and S_{S-1} into final_state (bf16 or fp32) where it is given.
// All buffers [.., H, 128, 128] fp32, segment_stride elements apart (N = 1).
struct StitchChain {
  float* boundary;          // [S - 1] S_s^T at the end of segments 0 .. S-2 (S_0^T read, the rest written)
  const float* a_t;         // [S - 1] A_s^T of segments 1 .. S-1 (index s - 1)
  const float* b_t;         // [S - 1] B_s^T of segments 1 .. S-1
  void* final_state;        // [1, H, 128, 128], or nullptr: the chain stops at S_{S-2}
  bool final_f32;
  int segments;             // S
  int steps;                // S - 1 with a final state, else S - 2
  int64_t segment_stride;   // elements between two segments' buffers
};

// How the state pass is laid out: a block holds `value_slices` slices of 16 value columns of one
// head, each slice split over `key_parts` warps by key channels. Supported: 8x1, 4x1, 2x2, 1x4.
struct StateConfig {
  int value_slices;
  int key_parts;
};

// Prep: a block of 128 threads per (slot, head), heads fastest, then slots. State pass: see
// state_kernel.cu; its persistent form (8x1 layout, min(N H, sms) blocks; no split): see
// state_persistent_kernel.cu.
// The fused chunk-64 prefill (fused_kernel.cu, fused_config.h): one block a (sequence, head),
// prep and state chain in one kernel, no workspace. Safe gate, V-major states without pools or
// checkpoints, q, k, v, g rows readable by the copy engine (the plan checks).
struct FusedParams {
  CUtensorMap q_tiles, k_tiles, g_tiles, v_tiles;  // [total, H, 128] bf16, boxes of [64 tokens][64], 128-byte swizzle
  CUtensorMap out_tiles;                            // out, the same boxes (the step's stores of full chunks)
  ActivationView beta;                              // [total, H], any strides
  const float* A_log;                               // [H]
  const float* dt_bias;                             // [H, 128]
  float lower_bound, scale;
  int num_heads;
  SequenceTable seqs;
  const void* initial_state;  // [N, H, 128, 128] V-major, or nullptr (zeros)
  bool initial_f32;
  void* final_state;          // [N, H, 128, 128] V-major, or nullptr
  bool final_f32;
  uint16_t* out;              // [total, H, 128] bf16, dense
  // The elementwise pass's channel groups of 8 (fused_config.h): part 0 takes [0, split[0]),
  // part 1 [split[0], split[1]), part 2 the rest (PrefillPlan::fused_split).
  int split[2];
  // Blocks take the sequences longest first (block i: the sequence of rank i / H, head i % H), so
  // that the longest chains start in the first wave instead of running alone at the end; else
  // sequence i / H. At most kMaxLongestFirstSeqs sequences.
  bool longest_first;
  // Two blocks an item (a cluster, fused_config.h): block r runs chunks r, r + 2, .., each keeping
  // its own copy of the state and applying the other's updates, handed over after each step, so
  // that each block prepares every other chunk while the other steps. For items that fill at most
  // half the multiprocessors (PrefillPlan::fused_pair).
  bool pair;
  bool pair_prefetch;  // pair: each chunk's inputs into the L2 a chunk ahead (FLASHKDA_FUSED_PAIR_PREFETCH=1; off by default)
  // The split pass's runs (segments > 0; PrefillPlan::split_fused): block i runs run i / H of head
  // i % H over its segment of the one sequence (StateSplit's runs and buffers; fused_kernel.cu,
  // Form::kSplitRun), and the stitch kernels combine them as they do the state passes' runs.
  StateSplit split_runs{};
  // split_runs: a segment's B and A runs as the two blocks of a cluster that each prepare every
  // other chunk and hand the other the operands (PrefillPlan::split_shared; FLASHKDA_SPLIT_SHARED=1)
  bool split_shared = false;
};
void launch_fused(const FusedParams& p, cudaStream_t stream);

void launch_prep(const PrepParams& p, int64_t num_slots, cudaStream_t stream);
// The prep tail's grid (PrepTail): `blocks` blocks (six a multiprocessor; the ones that do not
// fit at first start where others left, and leave too); the state pass with p.ready set goes
// right after it (launch_state and launch_state_wgmma launch it programmatically).
void launch_prep_tail(const PrepParams& p, int blocks, cudaStream_t stream);
void launch_state(const StateParams& p, StateConfig config, cudaStream_t stream);
void launch_state_persistent(const StateParams& p, int sms, cudaStream_t stream);
// The experimental wgmma state pass (state_wgmma_kernel.cu): records in WgmmaRecord's layout,
// per item, V-major states, no checkpoints; one block of 256 threads per (sequence, head).
void launch_state_wgmma(const StateParams& p, cudaStream_t stream);
// grid.z = segment_launches: that many consecutive segments from p.segment on (row stitches).
void launch_stitch(const StitchParams& p, int heads, cudaStream_t stream, int segment_launches = 1);
// The out rows of segments 1 .. S-1 (p as for launch_stitch with segment 1, M transposed) by at
// most `sms` blocks, each keeping its (segment, head)'s M across consecutive row tiles.
void launch_stitch_rows(const StitchParams& p, int heads, int sms, cudaStream_t stream);
// StitchChain: a block per 64 rows of each head's S^T, every step in one launch (p.steps >= 1).
void launch_stitch_chain(const StitchChain& p, int heads, cudaStream_t stream);

}  // namespace flashkda::gpu
