// Launch parameters of the recurrent (per-token) kernel: decode, speculative verify, and every
// serving feature the chunked prefill does not take yet (pools, K-major states, per-token states,
// checkpoints, strided inputs, the softplus gate). Shared by the kernel and the host launch code.
#pragma once

#include <cstdint>

#include "flashkda/flashkda.h"
#include "gpu/common/activation_view.cuh"
#include "gpu/common/state_slots.cuh"
#include "gpu/prefill/sequences.cuh"

namespace flashkda::gpu {

struct RecurrentParams {
  ActivationView q, k, v, g, beta;  // q, k, g: D = 128; v: D = 128; beta: D = 1
  bool vector_loads;                // every row of q, k, v, g starts 8-byte aligned (picks the kernel)
  bool same_row_strides;            // q, k, v, g have the same strides: one row offset serves all four
  const float* A_log;               // [H]
  const float* dt_bias;             // [H, 128]
  int num_heads;
  SequenceTable seqs;
  // States [slots, H, 128, 128] in `layout`, at the slots of `slots`.
  const void* initial_state;        // or nullptr: sequences start from zero
  bool initial_bf16;
  void* final_state;                // or nullptr: no state written
  bool final_bf16;
  StateSlotTable slots;
  IndexView token_indices;          // [N, token_columns]: the state after token t to slot [n, t]
                                    // (then no final state without slots.final)
  int64_t token_columns;
  CheckpointTable checkpoints;      // in `layout`
  uint16_t* out;                    // [total, H, 128] bf16, dense
  bool out_aliases_input;           // out is the buffer of q, k, v or g (see recurrent_kernel.cu)
  float lower_bound, scale;
  bool softplus_gate;
};

// One block of 32 threads per (sequence, head, 16 value rows); 256 per (sequence, head)
// when out aliases an input.
void launch_recurrent(const RecurrentParams& p, StateLayout layout, cudaStream_t stream);

}  // namespace flashkda::gpu
