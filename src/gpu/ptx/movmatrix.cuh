// Shared-memory addressing and the movmatrix wrapper (an 8x8 bf16 transpose in registers).
#pragma once

#include <cstdint>

namespace flashkda::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Transposes an 8x8 bf16 matrix held one row-pair per lane (C-fragment order) in registers.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace flashkda::ptx
