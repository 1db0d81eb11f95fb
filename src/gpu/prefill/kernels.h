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
};

// How the state pass is laid out: a block holds `value_slices` slices of 16 value columns of one
// head, each slice split over `key_parts` warps by key channels. Supported: 8x1, 4x1, 2x2, 1x4.
struct StateConfig {
  int value_slices;
  int key_parts;
};

// Prep: grid (slots, H), 128 threads. State pass: see state_kernel.cu.
void launch_prep(const PrepParams& p, int64_t num_slots, cudaStream_t stream);
void launch_state(const StateParams& p, StateConfig config, cudaStream_t stream);

}  // namespace flashkda::gpu
