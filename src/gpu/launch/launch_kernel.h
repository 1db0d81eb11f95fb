// Kernel launch with an optional programmatic dependency on the previous kernel in the stream
// (ptx/grid_dependency.cuh): the kernel's blocks may start, and run up to their griddep_wait,
// while that kernel's last blocks finish.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashkda::gpu {

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                          bool overlap_previous, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = overlap_previous ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashkda::gpu
