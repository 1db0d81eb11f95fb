#include "gpu/launch/device_views.h"

namespace flashkda::gpu {

IndexView index_view(const void* data, DType dtype) { return {data, dtype == DType::kI32}; }

StateSlotTable state_slot_table(const Problem& p) {
  return {index_view(p.state_indices, p.state_indices_dtype),
          index_view(p.final_state_indices, p.final_state_indices_dtype), p.initial_slots, p.final_slots};
}

CheckpointTable checkpoint_table(const Problem& p) {
  if (!p.checkpoint_offsets) return {};
  return {index_view(p.checkpoint_offsets, p.checkpoint_offsets_dtype), p.checkpoints, p.checkpoint_state};
}

}  // namespace flashkda::gpu
