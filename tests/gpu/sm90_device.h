// Why a test that needs an sm_90 device cannot run here ("" when it can): the skip message of
// the standalone wgmma tests (`what` names them in it, which CTest's skip pattern matches).
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace flashkda::testing {

inline std::string sm90_unavailable(const char* what) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return std::string("no CUDA device: GPU ") + what + " tests skipped";
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major != 9)
    return "wgmma needs sm_90 (this device is sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  return "";
}

}  // namespace flashkda::testing
