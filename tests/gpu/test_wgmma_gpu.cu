// The wgmma wrappers (gpu/ptx/wgmma.cuh) on the device: D = A B^T for m64n16k8 and m64n128k8
// tf32 over two k-steps, with the fragment layouts and the descriptor fields that header states,
// against the product on the host. Small integers are exact in tf32 and their sums in fp32, so
// the comparison is exact. A second run with the descriptor's byte offsets swapped must not
// match: it shows which field is which (the leading offset runs along K).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gpu/ptx/wgmma.cuh"
#include "sm90_device.h"

namespace flashkda::testing {
namespace {

constexpr int kM = 64, kSteps = 2, kK = 8 * kSteps;
constexpr uint32_t kLbo = 128, kSbo = 256;  // B placement: K-adjacent core matrices 128 B apart, N-adjacent 256 B

// Byte offset of B element (n, k) of one k-step's [N][8] tile in the canonical no-swizzle layout.
__host__ __device__ constexpr uint32_t b_offset(int n, int k) {
  return (n / 8) * kSbo + (k / 4) * kLbo + (n % 8) * 16 + (k % 4) * 4;
}

template <int N>
__global__ void wgmma_product(const float* a, const float* b, float* d, bool swap_offsets) {
  __shared__ __align__(128) float bs[kSteps][N * 8];  // one [N][8] tile a k-step
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  for (int i = tid; i < kSteps * N * 8; i += 128) {
    const int s = i / (N * 8), n = (i / 8) % N, k = i % 8;
    bs[s][b_offset(n, k) / 4] = b[n * kK + 8 * s + k];
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();

  uint32_t frag[kSteps][4];
  const int row = 16 * warp + g;
  for (int s = 0; s < kSteps; ++s) {
    frag[s][0] = __float_as_uint(a[row * kK + 8 * s + t]);
    frag[s][1] = __float_as_uint(a[(row + 8) * kK + 8 * s + t]);
    frag[s][2] = __float_as_uint(a[row * kK + 8 * s + t + 4]);
    frag[s][3] = __float_as_uint(a[(row + 8) * kK + 8 * s + t + 4]);
  }
  float acc[N / 2];
  for (float& x : acc) x = 0.0f;
  ptx::wgmma_fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const uint64_t desc = swap_offsets ? ptx::smem_matrix_desc(bs[s], kSbo, kLbo) : ptx::smem_matrix_desc(bs[s], kLbo, kSbo);
    ptx::wgmma_tf32<N>(acc, frag[s], desc, s > 0);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
    for (int r = 0; r < 2; ++r) {
      d[(row + 8 * r) * N + 8 * j + 2 * t] = acc[4 * j + 2 * r];
      d[(row + 8 * r) * N + 8 * j + 2 * t + 1] = acc[4 * j + 2 * r + 1];
    }
}

class GpuWgmma : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = sm90_unavailable("wgmma"); !why.empty()) GTEST_SKIP() << why;
  }
};

// Runs the kernel; returns the number of elements of D that differ from the host product.
template <int N>
int mismatches(bool swap_offsets) {
  std::mt19937 rng(N);
  std::uniform_int_distribution<int> small(-4, 4);
  std::vector<float> a(kM * kK), b(N * kK), d(kM * N, -1.0f), want(kM * N, 0.0f);
  for (float& x : a) x = static_cast<float>(small(rng));
  for (float& x : b) x = static_cast<float>(small(rng));
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < kK; ++k) want[m * N + n] += a[m * kK + k] * b[n * kK + k];
  float *da, *db, *dd;
  cudaMalloc(&da, a.size() * 4);
  cudaMalloc(&db, b.size() * 4);
  cudaMalloc(&dd, d.size() * 4);
  cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice);
  wgmma_product<N><<<1, 128>>>(da, db, dd, swap_offsets);
  const cudaError_t err = cudaDeviceSynchronize();
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  int bad = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] != want[i] && bad++ < 4)
      std::printf("  [wgmma n%d%s] D[%zu][%zu] = %g, want %g\n", N, swap_offsets ? " swapped" : "", i / N, i % N,
                  d[i], want[i]);
  }
  return bad;
}

TEST_F(GpuWgmma, M64N16K8Tf32MatchesTheHostProduct) {
  EXPECT_EQ(mismatches<16>(false), 0);
  std::printf("  [wgmma n16] with the byte offsets swapped: %d of %d elements differ\n", mismatches<16>(true), kM * 16);
}

TEST_F(GpuWgmma, M64N128K8Tf32MatchesTheHostProduct) {
  EXPECT_EQ(mismatches<128>(false), 0);
  EXPECT_GT(mismatches<128>(true), 0) << "swapping the leading and stride offsets changed nothing";
}

}  // namespace
}  // namespace flashkda::testing
