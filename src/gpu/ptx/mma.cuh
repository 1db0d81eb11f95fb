// mma.sync wrappers. Fragment layouts use g = lane / 4, t = lane % 4; the fp32 accumulator
// (16x8) is c[0..1] (row g, cols 2t, 2t+1) and c[2..3] (row g+8, same cols).
#pragma once

#include <cstdint>

namespace flashkda::ptx {

// D = A * B + C for m16n8k8 with tf32 inputs (fp32 bit patterns; the low 13 mantissa bits are
// ignored), fp32 accumulators. Fragments: a[0] (row g, k t)  a[1] (row g+8, k t)
// a[2] (row g, k t+4)  a[3] (row g+8, k t+4); b[0] (k t, col g)  b[1] (k t+4, col g).
// Any order of k inside the tile works if A and B agree: taking k-slot t = element 2t and slot
// t+4 = element 2t+1 makes the C fragment of one n-tile directly an A fragment, and a B fragment
// one 8-byte load of two adjacent elements.
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// D = A * B + C for m16n8k16 with fp16 inputs (two a register, the lower k in the low half),
// fp32 accumulators. Fragments: a[0] (row g, k 2t, 2t+1)  a[1] (row g+8, k 2t, 2t+1)
// a[2] (row g, k 2t+8, 2t+9)  a[3] (row g+8, k 2t+8, 2t+9); b0 (k 2t, 2t+1, col g)
// b1 (k 2t+8, 2t+9, col g). The C fragments of n-tiles 2j and 2j+1 packed in pairs are the A
// fragment of k-tile j as they stand: (c[0], c[1]), (c[2], c[3]) of 2j, then of 2j+1.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment (k-slot t = element 2t, slot t+4 = element 2t+1) from one C fragment.
__device__ __forceinline__ void tf32_a_from_c(const float (&c)[4], uint32_t (&a)[4]) {
  a[0] = __float_as_uint(c[0]);
  a[1] = __float_as_uint(c[2]);
  a[2] = __float_as_uint(c[1]);
  a[3] = __float_as_uint(c[3]);
}

}  // namespace flashkda::ptx
