// Device-side views of a validated Problem's index arrays, built on the host for the launches.
#pragma once

#include "common/problem.h"
#include "gpu/common/activation_view.cuh"
#include "gpu/common/state_slots.cuh"

namespace flashkda::gpu {

IndexView index_view(const void* data, DType dtype);  // int32 or int64; null stays absent
StateSlotTable state_slot_table(const Problem& p);    // the state pools' slots (slot n without indices)
CheckpointTable checkpoint_table(const Problem& p);   // count 0 without checkpoints
// Rows of a [B, T, H, d] activation as the kernels index them (strides in elements).
ActivationView activation_view(const uint16_t* data, const RowStrides& s, const Problem& p, int64_t d);

}  // namespace flashkda::gpu
