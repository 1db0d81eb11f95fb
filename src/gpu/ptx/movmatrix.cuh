// Shared-memory addressing, the movmatrix wrapper (an 8x8 bf16 transpose in registers),
// stmatrix and ldmatrix (8x8 16-bit matrices between registers and shared memory).
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

// Stores four 8x8 16-bit matrices transposed: matrix m is register r[m] of every lane in C-fragment
// order (lane (g, t) holds row g, columns 2t, 2t + 1), and its column i lands as a 16-byte row at
// the address lane 8 m + i gives. An m16n16 C tile (rows x 16, columns y 16) thus becomes 16 rows of
// y, each 8 + 8 x values, in two 16-byte pieces.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Stores four 8x8 16-bit matrices: matrix m is register r[m] of every lane in C-fragment order,
// and its row i lands as 16 bytes at the address lane 8 m + i gives.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// Loads four 8x8 16-bit matrices: lane 8 m + i gives the address of row i of matrix m (16 bytes),
// and register r[m] of lane (g, t) receives row g, columns 2t, 2t + 1 of matrix m (C-fragment
// order: the four of an m16k16 tile in the order a[0..3] of mma_f16_16816 are its A fragment).
__device__ __forceinline__ void ldmatrix_x4(uint32_t row_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr)
               : "memory");
}

// The same, transposed: register r[m] of lane (g, t) receives rows 2t, 2t + 1 of column g of
// matrix m (the lower row in the low half).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t row_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr)
               : "memory");
}

}  // namespace flashkda::ptx
