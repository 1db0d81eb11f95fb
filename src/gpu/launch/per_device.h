// Values read or set up once per device on the host (kernel attributes, device properties):
// per device because they belong to the current device's context.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "common/fail.h"

namespace flashkda::gpu {

template <typename T>
class PerDevice {
 public:
  // The current device's value: fn(T&) (returning cudaError_t) computes it unless it already
  // succeeded on this device; `what` names the step in the error.
  template <typename Fn>
  T get(const char* what, Fn&& fn) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) fail(ErrorCode::kCudaError, what, ": cannot read the current device");
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached && ready_[device].load(std::memory_order_acquire)) return value_[device].load(std::memory_order_relaxed);
    T value{};
    const cudaError_t err = fn(value);
    if (err != cudaSuccess) fail(ErrorCode::kCudaError, what, " failed: ", cudaGetErrorString(err));
    if (cached) {
      value_[device].store(value, std::memory_order_relaxed);
      ready_[device].store(true, std::memory_order_release);
    }
    return value;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<T> value_[kMaxDevices] = {};
  std::atomic<bool> ready_[kMaxDevices] = {};
};

// Set-up that runs once per device: fn() returns cudaError_t.
class PerDeviceOnce {
 public:
  template <typename Fn>
  void run(const char* what, Fn&& fn) {
    done_.get(what, [&](bool& done) {
      done = true;
      return fn();
    });
  }

 private:
  PerDevice<bool> done_;
};

}  // namespace flashkda::gpu
