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

ActivationView activation_view(const uint16_t* data, const RowStrides& s, const Problem& p, int64_t d) {
  ActivationView a{data, s.batch, s.token, s.head, p.T > 0 ? p.T : 1};
  if (s.dense) {
    a.batch = p.T * p.H * d;
    a.token = p.H * d;
    a.head = d;
  }
  // The stride of a dimension of size 1 is never used to step: give it the value that lets the
  // strides of a view be compared with the dense ones (a [B, 1] view's rows are `batch` apart).
  if (p.H == 1) a.head = d;
  if (p.T == 1) a.token = a.batch;
  if (p.B <= 1) a.batch = p.T * a.token;
  return a;
}

}  // namespace flashkda::gpu
