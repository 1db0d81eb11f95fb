// fp32 <-> bf16 pair packing, fp32 -> fp16 pairs and fp32 -> tf32 rounding.
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

// The same in fp16 (cvt.rn: values past 65504 become Inf, under 2^-14 subnormal).
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two fp16 products, lo * lo and hi * hi, rounded to nearest (subnormals kept: no .ftz).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ float2 unpack_bf16x2(uint32_t x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// x rounded to the nearest tf32 value (ties away from zero, as cvt.rna.tf32.f32), as an mma
// operand: half a tf32 ulp added to the bit pattern, whose low 13 bits the tensor cores then
// drop (`& 0xffffe000u` makes it the tf32 value itself). The add alone would wrap the canonical
// NaN 0x7fffffff to 0x80000fff, -0 to the tensor cores, and a NaN input would vanish from every
// product; the signed max keeps x itself exactly when the add wrapped. Two integer instructions
// where cvt.rna costs about four; the same result for every finite x, Inf becomes NaN. A NaN of
// the form 0xfffffxxx (a negated canonical NaN) would still wrap: round first, then negate.
__device__ __forceinline__ float tf32_operand(float x) {
  const int32_t bits = __float_as_int(x);
  const auto rounded = static_cast<int32_t>(static_cast<uint32_t>(bits) + 0x1000u);  // wraps, no UB
  return __int_as_float(max(rounded, bits));
}

// The tf32 value nearest x for a hi + lo split (lo = x - hi): the plain add, one instruction
// fewer than tf32_operand(x) & 0xffffe000u. It may turn a NaN into -0, which is harmless only
// because lo = NaN - hi is NaN and carries it.
__device__ __forceinline__ float tf32_high_part(float x) {
  return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}

}  // namespace flashkda::ptx
