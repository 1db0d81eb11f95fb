#include "common/problem.h"

namespace flashkda {

std::vector<int64_t> host_sequence_offsets(const Problem& p) {
  std::vector<int64_t> offsets(static_cast<size_t>(p.N) + 1);
  for (int64_t n = 0; n <= p.N; ++n) {
    if (!p.cu_seqlens) {
      offsets[n] = n * p.T;
    } else if (p.cu_seqlens_dtype == DType::kI32) {
      offsets[n] = static_cast<const int32_t*>(p.cu_seqlens)[n];
    } else {
      offsets[n] = static_cast<const int64_t*>(p.cu_seqlens)[n];
    }
  }
  return offsets;
}

}  // namespace flashkda
