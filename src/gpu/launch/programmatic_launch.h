// Kernel launches that may overlap the grid before them in the stream: programmatic dependent
// launch (sm_90). The state passes start this way after the prep grid, whose blocks let them
// (griddepcontrol.launch_dependents) as they start: the state grid is then launched while the
// prep grid's last blocks run, and its blocks set up where those leave room. Whatever reads the
// prep grid's writes waits for it first (griddepcontrol.wait, ptx/grid_sync.cuh).
// Without `programmatic`, a plain launch with the same error report (the prep, stitch and wgmma kernels).
#pragma once

#include <cuda_runtime.h>

#include "common/fail.h"

namespace flashkda::gpu {

// kernel<<<grid, block, smem, stream>>>(args...), programmatically after the grid before it in the
// stream where `programmatic` is set; `what` names the kernel in the error.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   bool programmatic, const char* what, const Args&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, what, " launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
