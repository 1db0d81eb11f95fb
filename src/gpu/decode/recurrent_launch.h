// The two forms of the recurrent kernel (recurrent_params.h); CudaPlan::recurrent picks one per
// call (gpu/launch/cuda_plan.cu).
#pragma once

#include <cuda_runtime.h>

#include "gpu/decode/recurrent_params.h"
#include "gpu/gpu_backend.h"

namespace flashkda::gpu {

// Blocks of 128 threads per (sequence, head, half of the value rows), each loading its tile once;
// 256 per (sequence, head) when out aliases an input (the only form that takes that case).
void launch_recurrent_blocks(const RecurrentParams& p, StateLayout layout, cudaStream_t stream);

// Persistent warps with the next items' tiles in flight (cp.async into a per-warp ring); not for
// an out that aliases an input.
void launch_recurrent_streaming(const RecurrentParams& p, StateLayout layout, cudaStream_t stream);

}  // namespace flashkda::gpu
