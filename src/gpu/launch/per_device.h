// "Once per device" for host-side set-up (kernel attributes): the flag is per device because
// function attributes belong to the current device's context.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "api/validate.h"

namespace flashkda::gpu {

class PerDeviceOnce {
 public:
  // Calls fn() (returning cudaError_t) unless it already succeeded on the current device;
  // `what` names the step in the error.
  template <typename Fn>
  void run(const char* what, Fn&& fn) {
    int device = 0;
    cudaGetDevice(&device);
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached && done_[device].load(std::memory_order_acquire)) return;
    const cudaError_t err = fn();
    if (err != cudaSuccess) fail(ErrorCode::kCudaError, what, " failed: ", cudaGetErrorString(err));
    if (cached) done_[device].store(true, std::memory_order_release);
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<bool> done_[kMaxDevices] = {};
};

}  // namespace flashkda::gpu
