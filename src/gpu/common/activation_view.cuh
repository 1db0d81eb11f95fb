// Rows of a q, k, v, g or beta input as the kernels read them: any token, head and batch strides
// (slices of a fused projection), the last dimension contiguous.
#pragma once

#include <cstdint>

namespace flashkda::gpu {

// Rows of a [B, T, H, D] activation (beta: D = 1): token row r = b * T + t starts at element
// b * batch + t * token + h * head. Dense tensors have batch = T*H*D, token = H*D, head = D.
struct ActivationView {
  const uint16_t* data;  // bf16 bits
  int64_t batch, token, head;
  int64_t rows_per_batch;  // T

  __device__ __forceinline__ const uint16_t* row(int64_t r, int h) const {
    return data + (r / rows_per_batch) * batch + (r % rows_per_batch) * token + h * head;
  }
  // Row r of head h where r's batch row b is known (no division): rows r, r + 1, ... of the same
  // batch row follow at `token` elements each.
  __device__ __forceinline__ const uint16_t* row_in_batch(int64_t b, int64_t r, int h) const {
    return data + offset_in_batch(b, r, h);
  }
  // The element offset of that row: the same for views with equal strides.
  __device__ __forceinline__ int64_t offset_in_batch(int64_t b, int64_t r, int h) const {
    return b * batch + (r - b * rows_per_batch) * token + h * head;
  }
  // Whether `other` has this view's strides, so that offset_in_batch serves both (host side: the
  // kernels' parameters say so once instead of comparing strides per row).
  bool same_strides(const ActivationView& other) const {
    return batch == other.batch && token == other.token && head == other.head && rows_per_batch == other.rows_per_batch;
  }
};

}  // namespace flashkda::gpu
