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

// x rounded to the nearest tf32 value (ties away from zero, as cvt.rna.tf32.f32), as an mma
// operand: half a tf32 ulp added to the bit pattern, whose low 13 bits the tensor cores then
// drop (`& 0xffffe000u` makes it the tf32 value itself). One integer add where cvt.rna costs
// about four instructions of Inf/NaN checks; the same result for finite x. A NaN may wrap to
// -0, so only where a NaN input also reaches the output another way: in the prep and state
// kernels every such operand has an fp32 or bf16 twin (Qe, Kr, W, exp(G_C), the state) that
// carries the NaN.
__device__ __forceinline__ float tf32_operand(float x) { return __uint_as_float(__float_as_uint(x) + 0x1000u); }

}  // namespace flashkda::ptx
