#include "common/problem.h"

namespace flashkda {

int64_t host_index(const void* indices, DType dtype, int64_t i) {
  return dtype == DType::kI32 ? static_cast<const int32_t*>(indices)[i] : static_cast<const int64_t*>(indices)[i];
}

std::vector<int64_t> host_sequence_offsets(const Problem& p) {
  std::vector<int64_t> offsets(static_cast<size_t>(p.N) + 1);
  for (int64_t n = 0; n <= p.N; ++n) offsets[n] = p.cu_seqlens ? host_index(p.cu_seqlens, p.cu_seqlens_dtype, n) : n * p.T;
  return offsets;
}

}  // namespace flashkda
