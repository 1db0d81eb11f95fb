// Pointer locations and device information through the CUDA runtime. Any runtime error here
// (no driver, no device) means "no usable device", never a crash.
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/gpu_backend.h"

namespace flashkda::gpu {

PointerInfo locate(const void* ptr) {
  PointerInfo info;
  if (!ptr || device_count() == 0) return info;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // unregistered host memory on old runtimes: clear the sticky-free error
    return info;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    info.on_device = true;
    info.device = attr.device;
  }
  return info;
}

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

int current_device() {
  int d = -1;
  if (device_count() == 0 || cudaGetDevice(&d) != cudaSuccess) return -1;
  return d;
}

std::string device_name() {
  const int d = current_device();
  if (d < 0) return "";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) return "";
  return prop.name;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) return false;
  return status != cudaStreamCaptureStatusNone;
}

void copy_to_host_sync(const std::vector<HostCopy>& copies, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  for (const HostCopy& c : copies)
    if (err == cudaSuccess) err = cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess)
    fail(ErrorCode::kCudaError, "reading index arrays (cu_seqlens, state indices, checkpoint offsets) from the device "
         "failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu

namespace flashkda {
bool cuda_compiled() { return true; }
}  // namespace flashkda
