// One-instruction exp2 and reciprocal (the MUFU unit) with denormals flushed to zero. Without
// -ftz, __expf and __fdividef wrap each MUFU in a range test and two multiplies that keep
// denormal results; the prep kernel's arguments never need them (|G| <= 80 nats for
// lower_bound >= -5, and a sigmoid's 1 + e^-x only loses what a denormal would add to 1).
#pragma once

namespace flashkda::ptx {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x log2(e))

__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashkda::ptx
