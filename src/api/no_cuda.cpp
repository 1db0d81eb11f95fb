// Built when the library has no CUDA kernels: every pointer is host memory and the CUDA path
// reports plainly that it is absent.
#include "api/validate.h"
#include "gpu/gpu_backend.h"

namespace flashkda::gpu {

PointerInfo locate(const void*) { return {}; }
int device_count() { return 0; }
int current_device() { return -1; }
std::string device_name() { return ""; }
bool stream_is_capturing(cudaStream_t) { return false; }

void copy_to_host_sync(const std::vector<HostCopy>&, cudaStream_t) {
  fail(ErrorCode::kNoDevice, "flashkda was built without CUDA: no device memory can be read");
}
CudaPlan plan_cuda(const Problem&) {
  fail(ErrorCode::kNoDevice, "flashkda was built without CUDA kernels: pass host tensors for the CPU backend");
}
void cuda_forward(const Problem&, const CudaPlan&, void*, cudaStream_t) {
  fail(ErrorCode::kNoDevice, "flashkda was built without CUDA kernels: pass host tensors for the CPU backend");
}

}  // namespace flashkda::gpu

namespace flashkda {
bool cuda_compiled() { return false; }
}  // namespace flashkda
