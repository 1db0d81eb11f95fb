// bf16 <-> fp32 conversion usable on host and device (round to nearest even, NaN kept).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLASHKDA_HD __host__ __device__ __forceinline__
#else
#define FLASHKDA_HD inline
#endif

namespace flashkda {

FLASHKDA_HD float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

FLASHKDA_HD uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace flashkda
