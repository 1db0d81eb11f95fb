// cp.async (sm_80+): a thread's own global -> shared copies, waited for by the same thread. No
// barrier is needed when each thread reads back only what it copied.
#pragma once

#include <cstdint>

#include "gpu/ptx/movmatrix.cuh"  // smem_addr

namespace flashkda::ptx {

// 8 bytes, both addresses 8-byte aligned (.ca: the only form for copies under 16 bytes).
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* global_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(smem_dst)), "l"(global_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits for every group this thread committed.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace flashkda::ptx
