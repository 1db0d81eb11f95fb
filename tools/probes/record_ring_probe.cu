// Probe (a measurement for docs/perf-notes.md, not a benchmark of results): how fast are the prep
// kernel and the state pass when the chunk records stay in the L2 instead of going through device
// memory? The question behind a spatial split of the two kernels (perf-notes, "What to try
// next"). No kernel changes: the workspace's records region is virtual memory whose 2 MB pages
// all map a small physical ring (cuMemMap of the same allocation over and over), so the prep
// kernel's 22.5 KB a record land in a few MB that the L2 can keep. The outputs are then wrong
// (records overwrite each other) and only times mean anything. Run under ncu for each kernel's
// time in each mode (`gpu-check.sh ring` does this for P1, P3 and P9):
//
//   ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_write.sum,dram__bytes_read.sum \
//       -k regex:"prep_kernel|state" build/tools/probes/record_ring_probe 1024 8 96 ring
//
//   record_ring_probe <tokens a sequence> <sequences> <heads> [both|plain|ring] [ring MB, 24] [calls, 20]
//
// Prints the median time of a call (CUDA events) with a plain workspace and / or with the ring.
// It turns the prep tail off (its ready flags follow the records and must not alias) and the
// split pass (its buffers too): the last 8 MB of the workspace are mapped one to one.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
void check(CUresult err, const char* what) {
  if (err != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + ": CUresult " + std::to_string(err));
}

template <typename Fn>
Fn driver_entry(const char* name) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status{};
  check(cudaGetDriverEntryPointByVersion(name, &ptr, 10020, cudaEnableDefault, &status), name);
  if (status != cudaDriverEntryPointSuccess) throw std::runtime_error(std::string("no driver entry point ") + name);
  return reinterpret_cast<Fn>(ptr);
}

// Deterministic pseudo-random bf16 in [-scale, scale] (a hash of the index), on the device.
__global__ void fill_bf16(uint16_t* x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float f = scale * (static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f);
    x[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
  }
}

struct DeviceMemory {
  void* ptr = nullptr;
  explicit DeviceMemory(size_t bytes) { check(cudaMalloc(&ptr, std::max<size_t>(bytes, 1)), "cudaMalloc"); }
  ~DeviceMemory() { cudaFree(ptr); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
};

// `bytes` of virtual memory: below `bytes - kOwnTail`, every 2 MB page maps the ring's pages in
// turn; the rest maps pages of its own.
class RingWorkspace {
 public:
  static constexpr size_t kOwnTail = size_t{8} << 20;

  RingWorkspace(size_t bytes, size_t ring_bytes) {
    auto get_granularity = driver_entry<PFN_cuMemGetAllocationGranularity_v10020>("cuMemGetAllocationGranularity");
    auto create = driver_entry<PFN_cuMemCreate_v10020>("cuMemCreate");
    auto reserve = driver_entry<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
    auto map = driver_entry<PFN_cuMemMap_v10020>("cuMemMap");
    auto set_access = driver_entry<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");
    unmap_ = driver_entry<PFN_cuMemUnmap_v10020>("cuMemUnmap");
    release_ = driver_entry<PFN_cuMemRelease_v10020>("cuMemRelease");
    free_ = driver_entry<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    check(get_granularity(&page_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
    size_ = (bytes + page_ - 1) / page_ * page_;
    const size_t ring = std::max(page_, ring_bytes / page_ * page_);
    const size_t aliased = size_ > kOwnTail + ring ? (size_ - kOwnTail) / ring * ring : 0;
    check(reserve(&base_, size_, 0, 0, 0), "cuMemAddressReserve");
    CUmemGenericAllocationHandle ring_handle, own_handle;
    check(create(&ring_handle, ring, &prop, 0), "cuMemCreate (ring)");
    handles_.push_back(ring_handle);
    for (size_t at = 0; at < aliased; at += ring) check(map(base_ + at, ring, 0, ring_handle, 0), "cuMemMap (ring)");
    if (size_ > aliased) {
      check(create(&own_handle, size_ - aliased, &prop, 0), "cuMemCreate (own)");
      handles_.push_back(own_handle);
      check(map(base_ + aliased, size_ - aliased, 0, own_handle, 0), "cuMemMap (own)");
    }
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(set_access(base_, size_, &access, 1), "cuMemSetAccess");
    aliased_ = aliased;
    ring_ = ring;
  }
  ~RingWorkspace() {
    unmap_(base_, size_);
    for (CUmemGenericAllocationHandle h : handles_) release_(h);
    free_(base_, size_);
  }
  RingWorkspace(const RingWorkspace&) = delete;
  RingWorkspace& operator=(const RingWorkspace&) = delete;

  void* data() const { return reinterpret_cast<void*>(base_); }
  size_t aliased() const { return aliased_; }
  size_t ring() const { return ring_; }

 private:
  CUdeviceptr base_ = 0;
  size_t size_ = 0, page_ = 0, aliased_ = 0, ring_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
  PFN_cuMemUnmap_v10020 unmap_;
  PFN_cuMemRelease_v10020 release_;
  PFN_cuMemAddressFree_v10020 free_;
};

float median_call_ms(const flashkda::ForwardArgs& args, void* workspace, size_t bytes, int calls) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 3; ++i) flashkda::forward(args, workspace, bytes);  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < calls; ++i) {
    check(cudaEventRecord(start), "record");
    flashkda::forward(args, workspace, bytes);
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <tokens a sequence> <sequences> <heads> [both|plain|ring] [ring MB, 24] [calls, 20]\n",
                 argv[0]);
    return 2;
  }
  try {
    using flashkda::DType;
    using flashkda::make_tensor;
    const int64_t len = std::atoll(argv[1]), N = std::atoll(argv[2]), H = std::atoll(argv[3]);
    const std::string mode = argc > 4 ? argv[4] : "both";
    const size_t ring_mb = argc > 5 ? std::strtoull(argv[5], nullptr, 10) : 24;
    const int calls = argc > 6 ? std::atoi(argv[6]) : 20;
    if (mode != "both" && mode != "plain" && mode != "ring") throw std::runtime_error("mode: both, plain or ring");
    if (len < 1 || N < 1 || H < 1 || ring_mb < 1 || calls < 1) throw std::runtime_error("sizes must be positive");
    setenv("FLASHKDA_PREP_TAIL", "0", 1);
    setenv("FLASHKDA_SPLIT", "0", 1);
    const int64_t T = len * N, D = 128;
    DeviceMemory q(T * H * D * 2), k(T * H * D * 2), v(T * H * D * 2), g(T * H * D * 2), beta(T * H * 2),
        out(T * H * D * 2), A_log(H * 4), dt_bias(H * D * 4), init(N * H * D * D * 2), final_state(N * H * D * D * 2),
        cu(8 * (N + 1));
    uint32_t seed = 1;
    for (DeviceMemory* m : {&q, &k, &v, &g, &init})
      fill_bf16<<<1024, 256>>>(static_cast<uint16_t*>(m->ptr), (m == &init ? N * H * D * D : T * H * D), seed++, 1.0f);
    fill_bf16<<<1024, 256>>>(static_cast<uint16_t*>(beta.ptr), T * H, seed++, 1.0f);
    check(cudaMemset(A_log.ptr, 0, H * 4), "memset");
    check(cudaMemset(dt_bias.ptr, 0, H * D * 4), "memset");
    std::vector<int64_t> offsets(N + 1);
    for (int64_t n = 0; n <= N; ++n) offsets[n] = n * len;
    check(cudaMemcpy(cu.ptr, offsets.data(), 8 * (N + 1), cudaMemcpyHostToDevice), "cu_seqlens");
    check(cudaDeviceSynchronize(), "inputs");

    flashkda::ForwardArgs a;
    a.q = make_tensor(q.ptr, DType::kBF16, 1, T, H, D);
    a.k = make_tensor(k.ptr, DType::kBF16, 1, T, H, D);
    a.v = make_tensor(v.ptr, DType::kBF16, 1, T, H, D);
    a.g = make_tensor(g.ptr, DType::kBF16, 1, T, H, D);
    a.beta = make_tensor(beta.ptr, DType::kBF16, 1, T, H);
    a.A_log = make_tensor(A_log.ptr, DType::kF32, H);
    a.dt_bias = make_tensor(dt_bias.ptr, DType::kF32, H, D);
    a.initial_state = make_tensor(init.ptr, DType::kBF16, N, H, D, D);
    a.final_state = make_tensor(final_state.ptr, DType::kBF16, N, H, D, D);
    a.cu_seqlens = make_tensor(cu.ptr, DType::kI64, N + 1);
    a.out = make_tensor(out.ptr, DType::kBF16, 1, T, H, D);
    a.scale = 1.0f / std::sqrt(128.0f);
    a.seqlen_check = flashkda::SeqlenCheck::kDeviceGuardsOnly;

    const size_t bytes = flashkda::forward_workspace_size(a);
    std::printf("%lld x [%lld] x %lld heads: workspace %.1f MB\n", static_cast<long long>(N),
                static_cast<long long>(len), static_cast<long long>(H), bytes / 1048576.0);
    if (mode != "ring") {
      DeviceMemory ws(bytes);
      std::printf("plain workspace: median of %d calls %.4f ms\n", calls, median_call_ms(a, ws.ptr, bytes, calls));
    }
    if (mode != "plain") {
      RingWorkspace ring(bytes, ring_mb << 20);
      std::printf("records on a %.0f MB ring (%.1f MB aliased; outputs not meaningful): median of %d calls %.4f ms\n",
                  ring.ring() / 1048576.0, ring.aliased() / 1048576.0, calls,
                  median_call_ms(a, ring.data(), bytes, calls));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "record_ring_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
