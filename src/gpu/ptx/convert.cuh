// fp32 <-> bf16 pair packing and fp32 -> tf32 rounding.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace flashkda::ptx {

// Packs (lo, hi) into one register: `lo` in the low 16 bits, round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// Rounds to the nearest tf32 value (10 mantissa bits), kept in an fp32 bit pattern.
__device__ __forceinline__ float round_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

}  // namespace flashkda::ptx
