// Programmatic dependent launch (sm_90): a kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream finishes; it
// waits for that kernel's results with griddep_wait. Both are no-ops without the attribute.
#pragma once

namespace flashkda::ptx {

// Lets the dependent kernel start launching once every block of this grid has executed it.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Waits until the prerequisite grids have completed and their memory operations are visible.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

}  // namespace flashkda::ptx
