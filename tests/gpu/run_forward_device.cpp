// run_forward() on the CUDA path, and the main() of the GPU serving suite: every given tensor of
// the host arguments is copied to a device buffer of its own (host pointers that are equal, such
// as an in-place pool, share one; strided views get their whole extent), forward() runs there
// with a workspace of the queried size, and the outputs (out, final_state, checkpoint_state) are
// copied back over the host buffers, so the host-side assertions see what the device wrote, and
// what it left alone (the host content went up as the device's starting content).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "api/arguments.h"
#include "common/run_forward.h"

namespace flashkda::testing {
namespace {

// Bytes from a tensor's first element to one past its last (its strides' whole span).
size_t extent_bytes(const Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.stride(i);
  return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(ErrorCode::kCudaError, std::string("test mirror: ") + what + ": " + cudaGetErrorString(err));
}

// Device copies of host buffers, freed with the mirror.
class Mirror {
 public:
  ~Mirror() {
    for (auto& [host, buf] : buffers_) cudaFree(buf.device);
    if (workspace_) cudaFree(workspace_);
  }
  void reserve(const void* host, size_t bytes) {
    size_t& b = buffers_[host].bytes;
    if (bytes > b) b = bytes;
  }
  void upload_all() {
    for (auto& [host, buf] : buffers_) {
      if (buf.bytes == 0) continue;
      check(cudaMalloc(&buf.device, buf.bytes), "cudaMalloc");
      check(cudaMemcpy(buf.device, host, buf.bytes, cudaMemcpyHostToDevice), "upload");
    }
  }
  void* device(const void* host) const { return buffers_.at(host).device; }
  void download(const void* host) const {
    const Buffer& buf = buffers_.at(host);
    if (buf.bytes) check(cudaMemcpy(const_cast<void*>(host), buf.device, buf.bytes, cudaMemcpyDeviceToHost), "download");
  }
  void* workspace(size_t bytes) {
    if (bytes) check(cudaMalloc(&workspace_, bytes), "cudaMalloc (workspace)");
    return workspace_;
  }

 private:
  struct Buffer {
    size_t bytes = 0;
    void* device = nullptr;
  };
  std::map<const void*, Buffer> buffers_;
  void* workspace_ = nullptr;
};

}  // namespace

void run_forward(const ForwardArgs& host) {
  Mirror mirror;
  for (const TensorArgument& arg : kTensorArguments)
    if (const Tensor& t = host.*arg.member; t.data) mirror.reserve(t.data, extent_bytes(t));
  mirror.upload_all();
  ForwardArgs dev = host;
  for (const TensorArgument& arg : kTensorArguments)
    if (Tensor& t = dev.*arg.member; t.data) t.data = mirror.device(t.data);
  const size_t bytes = forward_workspace_size(dev);
  forward(dev, mirror.workspace(bytes), bytes, nullptr);
  check(cudaDeviceSynchronize(), "running forward");
  for (const TensorArgument& arg : kTensorArguments)
    if (const Tensor& t = host.*arg.member; arg.output && t.data) mirror.download(t.data);
}

const char* backend_under_test() { return "cuda"; }

}  // namespace flashkda::testing

// The serving suites on the device. Without one, every test is skipped with a message (CTest
// reads it as a skip). FLASHKDA_CUDA_KERNELS=recurrent unless set: the checkpoint tests compare
// against prefix prefills bit for bit, which holds where both take the same kernels. The pool
// suite also runs with FLASHKDA_CUDA_KERNELS=auto (V-major pools then take the chunked prefill;
// tests/gpu/CMakeLists.txt and scripts/gpu-check.sh).
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device (or no driver): GPU serving tests skipped\n");
    return 0;
  }
  setenv("FLASHKDA_CUDA_KERNELS", "recurrent", 0);
  std::printf("serving suites on the CUDA path, FLASHKDA_CUDA_KERNELS=%s\n", std::getenv("FLASHKDA_CUDA_KERNELS"));
  return RUN_ALL_TESTS();
}
