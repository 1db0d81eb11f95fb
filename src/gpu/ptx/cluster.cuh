// Thread-block cluster wrappers for sm_90: the block's rank, another block's shared memory
// (distributed shared memory), arrivals on another block's mbarrier and the cluster barrier.
#pragma once

#include <cstdint>

#include "gpu/ptx/movmatrix.cuh"  // smem_addr

namespace flashkda::ptx {

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// The shared::cluster address of `local` (a shared::cta address) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

__device__ __forceinline__ void st_cluster_v4(uint32_t remote, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_cluster_v4(uint32_t remote, uint4 v) {
  asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(remote), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_cluster_v2(uint32_t remote, int2 v) {
  asm volatile("st.shared::cluster.v2.b32 [%0], {%1, %2};\n" ::"r"(remote), "r"(v.x), "r"(v.y) : "memory");
}

// This thread's earlier generic-proxy writes to shared memory of the cluster (st.shared::cluster)
// ordered before the async proxy's accesses (the other block's wgmma reading them).
__device__ __forceinline__ void fence_proxy_async_shared_cluster() { asm volatile("fence.proxy.async.shared::cluster;\n" ::: "memory"); }

// One arrival on an mbarrier of another block (a shared::cluster address from map_to_rank),
// ordering this thread's earlier stores (to either block) before it at cluster scope.
__device__ __forceinline__ void mbarrier_arrive_remote_release(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}

// Every thread of every block of the cluster: the blocks' earlier shared-memory writes (barrier
// initialisations included) are visible to all of them afterwards, and no block runs ahead.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace flashkda::ptx
