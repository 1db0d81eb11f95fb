// Per-thread asynchronous copies global -> shared (cp.async, sm_80+): each thread copies its own
// 8 or 16 bytes and waits for its own commit groups; no barrier is involved when a thread reads
// back only what it copied itself.
#pragma once

#include <cstdint>

#include "gpu/ptx/movmatrix.cuh"  // smem_addr

namespace flashkda::ptx {

// 8 bytes (both ends 8-byte aligned); .ca is the only form for fewer than 16 bytes.
__device__ __forceinline__ void cp_async_8(void* dst_smem, const void* src_gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem) : "memory");
}

// 16 bytes (both ends 16-byte aligned), bypassing L1: streamed data is read once.
__device__ __forceinline__ void cp_async_16(void* dst_smem, const void* src_gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem) : "memory");
}

// Closes the group of this thread's copies issued since the last commit (an empty group is fine).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` of this thread's newest groups are still in flight; the copies
// of every older group are then visible to this thread.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flashkda::ptx
