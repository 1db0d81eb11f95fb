#include "gpu/launch/device_views.h"

namespace flashkda::gpu {

IndexView index_view(const void* data, DType dtype) { return {data, dtype == DType::kI32}; }

StateSlotTable state_slot_table(const Problem& p) {
  return {index_view(p.state_indices, p.state_indices_dtype),
          index_view(p.final_state_indices, p.final_state_indices_dtype), p.initial_slots, p.final_slots};
}

}  // namespace flashkda::gpu
