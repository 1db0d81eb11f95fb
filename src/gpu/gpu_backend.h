// What the host-side dispatch needs from the CUDA side. Implemented by gpu/launch/*.cu when the
// library is built with CUDA, and by api/no_cuda.cpp otherwise (no device, clear errors).
#pragma once

#include <cstddef>
#include <string>

#include "common/problem.h"

namespace flashkda::gpu {

struct PointerInfo {
  bool on_device = false;  // device (or managed) memory
  int device = -1;         // its CUDA device when on_device
};

PointerInfo locate(const void* ptr);
int device_count();
int current_device();
std::string device_name();
bool stream_is_capturing(cudaStream_t stream);
// Copies `bytes` from device memory to the host and waits for it (orders after `stream`).
void copy_to_host_sync(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// The prefill kernels (K = V = 128, safe gate).
size_t prefill_workspace_size(const Problem& p);
void prefill_forward(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace flashkda::gpu
