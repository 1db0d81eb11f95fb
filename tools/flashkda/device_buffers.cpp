#include "device_buffers.h"

#include <utility>

#include "stats.h"

#if FLASHKDA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace flashkda::cli {

#if FLASHKDA_WITH_CUDA

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(ErrorCode::kCudaError, std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                           cudaGetErrorString(err) + ")");
}

}  // namespace

bool cuda_available(std::string* why) {
  if (!cuda_compiled()) {
    if (why) *why = "the library was built without CUDA kernels";
    return false;
  }
  if (cuda_device_count() == 0) {
    if (why) *why = "no CUDA device is visible (or no driver)";
    return false;
  }
  return true;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t err = cudaMalloc(&data_, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    data_ = nullptr;
    throw Error(ErrorCode::kCudaError, "cudaMalloc of " + std::to_string(bytes) + " bytes failed: " +
                                           cudaGetErrorString(err));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
}

void fill_device(void* dst, unsigned char byte, size_t bytes) {
  if (!bytes) return;
  check(cudaMemset(dst, byte, bytes), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

size_t device_free_bytes() {
  size_t free_bytes = 0, total = 0;
  check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return free_bytes;
}

size_t device_l2_bytes() {
  int device = 0, l2 = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess ||
      l2 <= 0) {
    cudaGetLastError();
    return size_t{60} << 20;
  }
  return static_cast<size_t>(l2);
}

Stream::Stream() { check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"); }
Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);
}
void Stream::synchronize() const { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

EventTimings::EventTimings(int count) : starts_(count, nullptr), stops_(count, nullptr) {
  for (int i = 0; i < count; ++i) {
    check(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&starts_[i])), "cudaEventCreate");
    check(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&stops_[i])), "cudaEventCreate");
  }
}

EventTimings::~EventTimings() {
  for (void* e : starts_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  for (void* e : stops_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void EventTimings::start(int i, cudaStream_t stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(starts_[i]), stream), "cudaEventRecord");
}

void EventTimings::stop(int i, cudaStream_t stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(stops_[i]), stream), "cudaEventRecord");
}

std::vector<double> EventTimings::elapsed_ms() const {
  std::vector<double> ms(starts_.size());
  for (size_t i = 0; i < starts_.size(); ++i) {
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(stops_[i])), "cudaEventSynchronize");
    float t = 0;
    check(cudaEventElapsedTime(&t, static_cast<cudaEvent_t>(starts_[i]), static_cast<cudaEvent_t>(stops_[i])),
          "cudaEventElapsedTime");
    ms[i] = t;
  }
  return ms;
}

double measure_copy_bandwidth(size_t bytes, int reps, cudaStream_t stream) {
  DeviceBuffer src(bytes), dst(bytes);
  fill_device(src.data(), 0x3c, bytes);
  for (int i = 0; i < 3; ++i)  // warm-up
    check(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  EventTimings timings(reps);
  for (int i = 0; i < reps; ++i) {
    timings.start(i, stream);
    check(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    timings.stop(i, stream);
  }
  const TimingStats s = summarize(timings.elapsed_ms());
  return 2.0 * static_cast<double>(bytes) / (s.median * 1e-3);
}

#else  // no CUDA: the tool's CPU paths only

namespace {
[[noreturn]] void no_cuda() {
  throw Error(ErrorCode::kNoDevice, "flashkda was built without CUDA: no device memory is available");
}
}  // namespace

bool cuda_available(std::string* why) {
  if (why) *why = "the library was built without CUDA kernels";
  return false;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) no_cuda();
}
DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  return *this;
}
void copy_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_to_host(void*, const void*, size_t) { no_cuda(); }
void fill_device(void*, unsigned char, size_t) { no_cuda(); }
size_t device_free_bytes() { no_cuda(); }
size_t device_l2_bytes() { no_cuda(); }
Stream::Stream() { no_cuda(); }
Stream::~Stream() = default;
void Stream::synchronize() const { no_cuda(); }
EventTimings::EventTimings(int) { no_cuda(); }
EventTimings::~EventTimings() = default;
void EventTimings::start(int, cudaStream_t) { no_cuda(); }
void EventTimings::stop(int, cudaStream_t) { no_cuda(); }
std::vector<double> EventTimings::elapsed_ms() const { no_cuda(); }
double measure_copy_bandwidth(size_t, int, cudaStream_t) { no_cuda(); }

#endif

}  // namespace flashkda::cli
