// Does compute-sanitizer's racecheck honour named barriers that two roles reach from different
// code? (docs/perf-notes.md, "The prep's chain cut by 45%": racecheck reports hazards on the fused
// prefill's hand-overs across such barriers, and the reports move when the barriers are arranged
// differently.) One block of 384 threads in the fused kernel's roles: warps 0-3 (prep) and 4-11
// (math), each in a loop of its own, hand values over through shared memory the way the kernel
// does: the prep warps write a per-chunk value and arrive on barrier 2, the math warps sync there
// and read it; the math warps write their partial values, both roles sync on barrier 1 (all
// threads), the prep warps read them, and a second barrier-1 sync ends the chunk. The program has
// no race by construction: every write and read of a slot are ordered by one of those barriers.
//
//   barrier_racecheck_probe [mode 0..3]   0: barrier.sync / barrier.arrive (non-aligned, as the
//                                         kernel since 78771e9); 1: bar.sync / bar.arrive (aligned);
//                                         2: 0 with each role's own subset barriers too;
//                                         3: 2 with setmaxnreg (probe's kSubsets, kRegs)
//   compute-sanitizer --tool racecheck barrier_racecheck_probe 0
//
// It prints the checksum of what the prep warps read (the same in both modes) and exits 0.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kThreads = 384, kPrepThreads = 128, kChunks = 64;

template <bool kAligned>
__device__ __forceinline__ void sync(int id, int threads) {
  if constexpr (kAligned) asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  else asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <bool kAligned>
__device__ __forceinline__ void arrive(int id, int threads) {
  if constexpr (kAligned) asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  else asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// kSubsets: each role also syncs on barriers of its own between the hand-overs (the prep warps on
// 3, each math warpgroup on 4 + its index), as the kernel's inverse and out rows do; kRegs: the
// roles rebalance registers with setmaxnreg (88 / 208), as the kernel does.
template <bool kAligned, bool kSubsets, bool kRegs>
__global__ void __launch_bounds__(kThreads, 1) probe(float* out) {
  __shared__ float inputs[kPrepThreads];                // prep -> math (like the norms)
  __shared__ float partials[kThreads - kPrepThreads];  // math -> prep (like the partial products)
  __shared__ float own[kThreads];                       // each role's own, across its subset barrier
  const int tid = static_cast<int>(threadIdx.x);
  float sum = 0.f;
  if (tid < kPrepThreads) {
    if constexpr (kRegs) asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n");
    for (int c = 0; c < kChunks; ++c) {
      inputs[tid] = static_cast<float>(c + tid);
      arrive<kAligned>(2, kThreads);  // the chunk's inputs are in
      sync<kAligned>(1, kThreads);    // the math warps' partials are in
      sum += partials[tid] + partials[tid + kPrepThreads];
      if constexpr (kSubsets) {
        own[tid] = sum;
        sync<kAligned>(3, kPrepThreads);
        sum += own[kPrepThreads - 1 - tid] * 0.f;
      }
      sync<kAligned>(1, kThreads);    // the partials read: the next chunk may write them
    }
  } else {
    if constexpr (kRegs) asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
    const int m = tid - kPrepThreads, wg = m / 128;
    for (int c = 0; c < kChunks; ++c) {
      sync<kAligned>(2, kThreads);
      partials[m] = 2.f * inputs[m % kPrepThreads];
      sync<kAligned>(1, kThreads);
      sync<kAligned>(1, kThreads);
      if constexpr (kSubsets) {
        own[tid] = static_cast<float>(c);
        sync<kAligned>(4 + wg, 128);
        sum += own[kPrepThreads + 128 * wg + (127 - m % 128)] * 0.f;
      }
    }
  }
  out[tid] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  float* out = nullptr;
  if (cudaMalloc(&out, kThreads * sizeof(float)) != cudaSuccess) return 1;
  switch (mode) {
    case 1: probe<true, false, false><<<1, kThreads>>>(out); break;
    case 2: probe<false, true, false><<<1, kThreads>>>(out); break;
    case 3: probe<false, true, true><<<1, kThreads>>>(out); break;
    default: probe<false, false, false><<<1, kThreads>>>(out); break;
  }
  float host[kThreads];
  const cudaError_t err = cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("probe failed: %s\n", cudaGetErrorString(err));
    return 1;
  }
  double sum = 0;
  for (float x : host) sum += x;
  // Expected: each prep thread t reads 2 (c + t) + 2 (c + t) = 4 (c + t) a chunk.
  double expected = 0;
  for (int t = 0; t < kPrepThreads; ++t)
    for (int c = 0; c < kChunks; ++c) expected += 4.0 * (c + t);
  std::printf("mode %d (%s barriers): checksum %.0f, expected %.0f\n", mode, mode == 1 ? "aligned" : "non-aligned", sum, expected);
  cudaFree(out);
  return sum == expected ? 0 : 1;
}
