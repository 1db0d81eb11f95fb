#include "flashkda/flashkda.h"
#include "gpu/gpu_backend.h"

namespace flashkda {

int cuda_device_count() { return gpu::device_count(); }
std::string cuda_device_name() { return gpu::device_name(); }
const char* version() { return "0.1.0"; }

}  // namespace flashkda
