// Device memory, copies, streams and event timing for the tool. Built against the CUDA runtime
// when the library has CUDA (FLASHKDA_WITH_CUDA); otherwise every call throws
// Error(kNoDevice), so the tool still builds and runs its CPU paths on a machine without CUDA.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"

namespace flashkda::cli {

// Whether the CUDA path can run here; when not, *why says so in a sentence.
bool cuda_available(std::string* why);

// One device allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  unsigned char* bytes_at(size_t offset) const { return static_cast<unsigned char*>(data_) + offset; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void fill_device(void* dst, unsigned char byte, size_t bytes);  // synchronous
size_t device_free_bytes();
size_t device_l2_bytes();  // the current device's L2 size (60 MB when the query fails)

// A non-blocking stream, destroyed with the object.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

// Times enqueued work on a stream with CUDA events: record(i) brackets call i; after
// synchronize(), elapsed_ms() gives each bracket's GPU time.
class EventTimings {
 public:
  EventTimings(int count);
  ~EventTimings();
  EventTimings(const EventTimings&) = delete;
  EventTimings& operator=(const EventTimings&) = delete;
  void start(int i, cudaStream_t stream);
  void stop(int i, cudaStream_t stream);
  std::vector<double> elapsed_ms() const;  // waits for the events

 private:
  std::vector<void*> starts_, stops_;
};

// Device-to-device copy bandwidth in bytes/s (bytes read + written), median of `reps`
// cudaMemcpyAsync timings of a `bytes`-long buffer.
double measure_copy_bandwidth(size_t bytes, int reps, cudaStream_t stream);

}  // namespace flashkda::cli
