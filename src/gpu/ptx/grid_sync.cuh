// Synchronisation between two grids that run at once (sm_90): programmatic dependent launch
// (griddepcontrol) and flags in global memory read and written at GPU scope. One instruction each.
#pragma once

#include <cstdint>

namespace flashkda::ptx {

// Lets the grid launched after this one with programmatic stream serialization start once every
// block of this grid has issued it (or exited); a no-op when no such grid follows.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Waits until the grid this one was launched after (programmatically) has completed and its
// memory operations are visible; returns at once when there is none.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ __forceinline__ uint32_t load_acquire_gpu(const uint32_t* flag) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_gpu(uint32_t* flag, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
}

// Orders this thread's ordinary (generic-proxy) global accesses with the copy engine's
// (async-proxy) accesses: data written by plain stores in one grid and read by bulk copies in a
// grid running at the same time needs it on both sides of the flag that hands it over.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

__device__ __forceinline__ void nanosleep(uint32_t ns) { asm volatile("nanosleep.u32 %0;\n" ::"r"(ns)); }

// The multiprocessor this thread runs on (0 .. the device's count - 1).
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}

}  // namespace flashkda::ptx
