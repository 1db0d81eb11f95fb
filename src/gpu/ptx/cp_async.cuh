// cp.async (sm_80+): a thread's 16-byte global -> shared copies, completed by groups. For data a
// block lays out itself (padded rows), where a tensor map's box cannot: the copy lands in shared
// memory without passing through the thread's registers.
#pragma once

#include "gpu/ptx/movmatrix.cuh"  // smem_addr

namespace flashkda::ptx {

// 16 bytes, both addresses 16-byte aligned; .cg: through the L2 only (the data is read once here).
__device__ __forceinline__ void cp_async_16(void* dst_smem, const void* src_gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem) : "memory");
}

// Closes this thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's groups are still in flight. The copies are then
// visible to this thread; other threads see them after a barrier.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flashkda::ptx
