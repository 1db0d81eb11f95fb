// Launch parameters of the prefill kernels (shared by the kernels and the host launch code).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gpu/prefill/sequences.cuh"

namespace flashkda::gpu {

struct PrepParams {
  const uint16_t* q;     // [total, H, 128] bf16
  const uint16_t* k;     // [total, H, 128]
  const uint16_t* g;     // [total, H, 128]
  const uint16_t* beta;  // [total, H]
  const float* A_log;    // [H]
  const float* dt_bias;  // [H, 128]
  float lower_bound;
  float scale;
  int num_heads;
  SequenceTable seqs;
  uint8_t* records;      // [slots, H, ChunkRecord::kBytes]
  unsigned long long* item_counter;  // zeroed by block (0, 0) for the persistent state pass, or nullptr
};

// Buffers of the segment-parallel state pass (all fp32, in the workspace; see state_kernel.cu):
// a sequence's chunks split at mid into two segments, segment 1 run from zero (B) and from the
// identity with v = 0 (A) while segment 0 runs from the initial state. Then, linear in the
// state at mid S_m: out = out_b + out_a S_m (rows of segment 1) and S_end = A S_m + B.
struct StateSplit {
  float* mid_state = nullptr;  // [N, H, 128 v, 128 k] S_m^T; nullptr: the pass is not split
  float* b_t = nullptr;        // [N, H, 128, 128] B^T
  float* a_t = nullptr;        // [N, H, 128 j, 128 k] A^T (row j: A's column j)
  float* out_b = nullptr;      // [total, H, 128 v] segment-1 rows
  float* out_a = nullptr;      // [total, H, 128 j] segment-1 rows
};

struct StateParams {
  CUtensorMap v_rows;          // v [total, H, 128] bf16, boxes of 16 tokens of one head
  const uint8_t* records;      // [slots, H, ChunkRecord::kBytes]
  int num_heads;
  SequenceTable seqs;
  const void* initial_state;   // [N, H, 128, 128] or nullptr
  bool initial_state_f32;
  void* final_state;           // [N, H, 128, 128] or nullptr
  bool final_state_f32;
  uint16_t* out;               // [total, H, 128] bf16
  StateSplit split;
  unsigned long long* item_counter = nullptr;  // persistent pass: items handed out past the first grid's worth
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
  int64_t rows;          // rows per head; with segment1_rows only those of segment 1 are written
  int64_t row_stride;    // elements between rows of X, Z, Y
  int64_t head_stride;   // elements between heads of X, Z, Y
  int64_t m_head_stride;
  bool segment1_rows;    // rows of sequence 0's segment 1 (the split pass's out rows)
  SequenceTable seqs;
};

// How the state pass is laid out: a block holds `value_slices` slices of 16 value columns of one
// head, each slice split over `key_parts` warps by key channels. Supported: 8x1, 4x1, 2x2, 1x4.
struct StateConfig {
  int value_slices;
  int key_parts;
};

// Prep: grid (slots, H), 128 threads. State pass: see state_kernel.cu; its persistent form
// (8x1 layout, min(N H, sms) blocks; no split): see state_persistent_kernel.cu.
void launch_prep(const PrepParams& p, int64_t num_slots, cudaStream_t stream);
void launch_state(const StateParams& p, StateConfig config, cudaStream_t stream);
void launch_state_persistent(const StateParams& p, int sms, cudaStream_t stream);
void launch_stitch(const StitchParams& p, int heads, cudaStream_t stream);

}  // namespace flashkda::gpu
