// A prototype of the state pass's chunk step on wgmma (docs/perf-notes.md, "What to try next"),
// before any kernel is built on it: two warpgroups hold one head's state S^T [128 v][128 k] in
// fp32 accumulators (64 value rows each) and run
//   X^T = S^T Wk^T,  WV^T = V^T W^T (W = hi + lo),  U^T = WV^T - X^T,
//   O^T = S^T Qe^T + WV^T M^T,  S^T = S^T Diag(decay) + U^T Kr
// with every B operand read from shared memory once a warpgroup. The test checks the step
// against fp64 on the host over a few chunks (a layout check: a wrong fragment or descriptor
// gives O(1) errors, tf32 gives ~1e-3), then times it: one block a head, the same chunk in
// shared memory every step (no copies), so the time is the step's own, comparable to the 8x1
// mma.sync step (1.34 us at P1, docs/perf-notes.md).
//
// Status (2026-12-01): written without device time left; not yet run on a GPU. ptxas compiles it
// without serializing a wgmma (no C7511 / C7517 / C7519 with -Xptxas -v), 178 registers.
// Run it alone: build/tests/gpu/test_wgmma_step_gpu.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::testing {
namespace {

constexpr int kD = 128, kC = 16;  // head size, chunk tokens

// The k order inside an 8-wide k-step that makes a D fragment an A fragment (mma.cuh): k-slot
// s < 4 holds element 2 s, slot s + 4 element 2 s + 1. B operands multiplied by an A taken from
// a D fragment store their k in this order.
__host__ __device__ constexpr int permuted(int slot) { return slot < 4 ? 2 * slot : 2 * (slot - 4) + 1; }

// Canonical no-swizzle K-major B tile [rows][8 k-slots] of one k-step: core matrices of 8 rows x
// 4 slots (128 B), LBO = 128 along k, SBO = 256 along rows. Byte offset of (row, slot).
__host__ __device__ constexpr uint32_t canonical(int row, int slot) {
  return (row / 8) * 256 + (slot / 4) * 128 + (row % 8) * 16 + (slot % 4) * 4;
}

// One chunk's operands in shared memory, each B tile by k-step.
struct StepSmem {
  float wk[16][kC * 8];    // Wk [16 t][128 k]: k-step s = k 8s .., k permuted (A from S^T)
  float qe[16][kC * 8];    // Qe, the same
  float kr[2][kD * 8];     // Kr as B [128 k][16 t]: k-step s = t 8s .., t permuted (A from U^T)
  float w[2][2][kC * 8];   // [hi, lo][k-step over t'] W [16 t][16 t'], t' in order (A from V^T loads)
  float m[2][kC * 8];      // M [16 t][16 t'], t' permuted (A from WV^T)
  float decay[kD];
  uint16_t v[kC][kD];      // V [16 t][128 v] bf16, as the chunk's v rows arrive
};

// Host images of the logical matrices into StepSmem's layouts.
void pack(StepSmem& s, const std::vector<float>& wk, const std::vector<float>& qe, const std::vector<float>& kr,
          const std::vector<float>& w_hi, const std::vector<float>& w_lo, const std::vector<float>& m,
          const std::vector<float>& decay, const std::vector<uint16_t>& v) {
  for (int st = 0; st < 16; ++st)
    for (int t = 0; t < kC; ++t)
      for (int slot = 0; slot < 8; ++slot) {
        const int k = 8 * st + permuted(slot);
        s.wk[st][canonical(t, slot) / 4] = wk[t * kD + k];
        s.qe[st][canonical(t, slot) / 4] = qe[t * kD + k];
      }
  for (int st = 0; st < 2; ++st)
    for (int k = 0; k < kD; ++k)
      for (int slot = 0; slot < 8; ++slot) s.kr[st][canonical(k, slot) / 4] = kr[(8 * st + permuted(slot)) * kD + k];
  for (int st = 0; st < 2; ++st)
    for (int t = 0; t < kC; ++t)
      for (int slot = 0; slot < 8; ++slot) {
        s.w[0][st][canonical(t, slot) / 4] = w_hi[t * kC + 8 * st + slot];
        s.w[1][st][canonical(t, slot) / 4] = w_lo[t * kC + 8 * st + slot];
        s.m[st][canonical(t, slot) / 4] = m[t * kC + 8 * st + permuted(slot)];
      }
  for (int k = 0; k < kD; ++k) s.decay[k] = decay[k];
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) s.v[t][c] = v[t * kD + c];
}

// A fragment for k-step j from an m64nN D fragment (tf32_a_from_c of mma.cuh).
template <int R>
__device__ __forceinline__ void a_from_d(const float (&d)[R], int j, uint32_t (&a)[4]) {
  a[0] = __float_as_uint(d[4 * j]);
  a[1] = __float_as_uint(d[4 * j + 2]);
  a[2] = __float_as_uint(d[4 * j + 1]);
  a[3] = __float_as_uint(d[4 * j + 3]);
}

__device__ __forceinline__ uint64_t desc(const void* tile) { return ptx::smem_matrix_desc(tile, 128, 256); }

// Block: 256 threads, warpgroup wg takes value rows 64 wg ... state_io [128 v][128 k] fp32 in/out;
// out [steps][128 v][16 t] fp32 (O^T of each step, when out is not null).
__global__ void __launch_bounds__(256, 1) wgmma_steps(const StepSmem* chunk, float* state_io, float* out, int steps) {
  __shared__ __align__(128) StepSmem sm;
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(StepSmem) / 4); i += 256)
    reinterpret_cast<uint32_t*>(&sm)[i] = reinterpret_cast<const uint32_t*>(chunk)[i];
  ptx::fence_proxy_async_shared();
  __syncthreads();

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int row = 64 * wg + 16 * warp + g;  // this lane's value rows: row, row + 8
  float* state = state_io + static_cast<int64_t>(blockIdx.x) * kD * kD;
  float s[64];  // S^T [64 v][128 k] of the warpgroup as an m64n128 D fragment
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      s[4 * j + 2 * r] = state[(row + 8 * r) * kD + 8 * j + 2 * t4];
      s[4 * j + 2 * r + 1] = state[(row + 8 * r) * kD + 8 * j + 2 * t4 + 1];
    }

  for (int step = 0; step < steps; ++step) {
    float x[8] = {}, o[8] = {}, wv[8] = {};  // written by the first product of each (scale-d false)
    // Every A operand of a group is formed (and pinned) before it starts. S^T's accumulator
    // registers serve as A as they are; WV^T's (an m64n16 accumulator) must be copied into
    // registers of their own before they feed the next product, or ptxas serializes every wgmma
    // of the kernel (C7511): adding half a tf32 ulp makes the copy and rounds what the tensor
    // cores then truncate.
    uint32_t as[16][4], av[2][4];  // S^T's by k-step; V^T's: (v row, t' = 8 st + t4 (+4))
#pragma unroll
    for (int st = 0; st < 16; ++st) a_from_d(s, st, as[st]);
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      av[st][0] = __float_as_uint(bf16_to_float(sm.v[8 * st + t4][row]));
      av[st][1] = __float_as_uint(bf16_to_float(sm.v[8 * st + t4][row + 8]));
      av[st][2] = __float_as_uint(bf16_to_float(sm.v[8 * st + t4 + 4][row]));
      av[st][3] = __float_as_uint(bf16_to_float(sm.v[8 * st + t4 + 4][row + 8]));
    }
#pragma unroll
    for (int st = 0; st < 16; ++st) ptx::fence_operands(as[st]);
    ptx::fence_operands(av[0]);
    ptx::fence_operands(av[1]);
    ptx::fence_operands(x);
    ptx::fence_operands(wv);
    ptx::wgmma_fence();
#pragma unroll
    for (int st = 0; st < 16; ++st) ptx::wgmma_tf32<16>(x, as[st], desc(sm.wk[st]), st > 0);
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      ptx::wgmma_tf32<16>(wv, av[st], desc(sm.w[0][st]), st > 0);
      ptx::wgmma_tf32<16>(wv, av[st], desc(sm.w[1][st]), true);
    }
    ptx::wgmma_commit();
    // O's products on S^T as a group of their own, issued while the first runs (two
    // accumulators on the same A registers in one group make ptxas inject warpgroup waits,
    // C7517 / C7519).
    ptx::fence_operands(o);
    ptx::wgmma_fence();
#pragma unroll
    for (int st = 0; st < 16; ++st) ptx::wgmma_tf32<16>(o, as[st], desc(sm.qe[st]), st > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // X and WV are done; O may still run
    ptx::fence_operands(x);
    ptx::fence_operands(wv);

    float u[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) u[i] = wv[i] - x[i];
    uint32_t aw[2][4], au[2][4];
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      a_from_d(wv, st, aw[st]);
      a_from_d(u, st, au[st]);
#pragma unroll
      for (int e = 0; e < 4; ++e) aw[st][e] += 0x1000u;  // registers of their own (see above)
      ptx::fence_operands(aw[st]);
      ptx::fence_operands(au[st]);
    }
    ptx::wgmma_wait<0>();  // O's products on S^T too: they read S^T's registers
    ptx::fence_operands(s);
    ptx::fence_operands(o);
    // S^T Diag(decay): column k = 8 j + 2 t4 (+1) of every block j.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(&sm.decay[8 * j + 2 * t4]);
      s[4 * j] *= d.x, s[4 * j + 1] *= d.y, s[4 * j + 2] *= d.x, s[4 * j + 3] *= d.y;
    }
    ptx::fence_operands(s);
    ptx::wgmma_fence();
#pragma unroll
    for (int st = 0; st < 2; ++st) ptx::wgmma_tf32<16>(o, aw[st], desc(sm.m[st]), true);
#pragma unroll
    for (int st = 0; st < 2; ++st) ptx::wgmma_tf32<128>(s, au[st], desc(sm.kr[st]), true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(s);
    ptx::fence_operands(o);
    if (out) {
      float* o_step = out + (static_cast<int64_t>(blockIdx.x) * steps + step) * kD * kC;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          o_step[(row + 8 * r) * kC + 8 * j + 2 * t4] = o[4 * j + 2 * r];
          o_step[(row + 8 * r) * kC + 8 * j + 2 * t4 + 1] = o[4 * j + 2 * r + 1];
        }
    } else {
      // Keep O live without a store of its own in the timed runs: fold it into the state's last
      // column block by a zero factor (never taken; the compiler cannot tell).
      if (o[0] == 1234.5f && o[7] == -1234.5f) s[63] += o[1];
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      state[(row + 8 * r) * kD + 8 * j + 2 * t4] = s[4 * j + 2 * r];
      state[(row + 8 * r) * kD + 8 * j + 2 * t4 + 1] = s[4 * j + 2 * r + 1];
    }
}

class GpuWgmmaStep : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device: GPU wgmma step tests skipped";
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    if (prop.major != 9) GTEST_SKIP() << "wgmma needs sm_90 (this device is sm_" << prop.major << prop.minor << ")";
    sms_ = prop.multiProcessorCount;
  }
  int sms_ = 0;
};

float tf32_hi(float x) {  // x rounded to the nearest tf32 (the hi part of a hi + lo split)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

TEST_F(GpuWgmmaStep, MatchesTheHostAndTimesTheStep) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> small(-0.1f, 0.1f), unit(-1.0f, 1.0f), dec(0.9f, 1.0f);
  std::vector<float> wk(kC * kD), qe(kC * kD), kr(kC * kD), w(kC * kC), w_hi(kC * kC), w_lo(kC * kC), m(kC * kC),
      decay(kD), s0(kD * kD);
  std::vector<uint16_t> v(kC * kD);
  for (float& x : wk) x = tf32_hi(small(rng));
  for (float& x : qe) x = tf32_hi(small(rng));
  for (float& x : kr) x = tf32_hi(small(rng));
  for (int i = 0; i < kC * kC; ++i) {
    w[i] = (i / kC >= i % kC) ? small(rng) * 5 : 0.0f;  // lower triangular, as W is
    w_hi[i] = tf32_hi(w[i]);
    w_lo[i] = tf32_hi(w[i] - w_hi[i]);
    m[i] = (i / kC >= i % kC) ? tf32_hi(small(rng)) : 0.0f;
  }
  for (float& x : decay) x = dec(rng);
  for (uint16_t& x : v) x = float_to_bf16(unit(rng));
  for (float& x : s0) x = unit(rng);

  StepSmem host{};
  pack(host, wk, qe, kr, w_hi, w_lo, m, decay, v);
  StepSmem* d_chunk;
  cudaMalloc(&d_chunk, sizeof(StepSmem));
  cudaMemcpy(d_chunk, &host, sizeof(StepSmem), cudaMemcpyHostToDevice);

  // Correctness: one block, 6 steps, against fp64.
  constexpr int kSteps = 6;
  float *d_state, *d_out;
  cudaMalloc(&d_state, sizeof(float) * kD * kD);
  cudaMalloc(&d_out, sizeof(float) * kSteps * kD * kC);
  cudaMemcpy(d_state, s0.data(), sizeof(float) * kD * kD, cudaMemcpyHostToDevice);
  wgmma_steps<<<1, 256>>>(d_chunk, d_state, d_out, kSteps);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got_s(kD * kD), got_o(kSteps * kD * kC);
  cudaMemcpy(got_s.data(), d_state, sizeof(float) * kD * kD, cudaMemcpyDeviceToHost);
  cudaMemcpy(got_o.data(), d_out, sizeof(float) * kSteps * kD * kC, cudaMemcpyDeviceToHost);

  std::vector<double> S(s0.begin(), s0.end()), ref_o(kSteps * kD * kC);  // S^T [v][k]
  for (int step = 0; step < kSteps; ++step) {
    std::vector<double> X(kD * kC), WV(kD * kC), U(kD * kC);
    for (int vr = 0; vr < kD; ++vr)
      for (int t = 0; t < kC; ++t) {
        double x = 0, q = 0, wvv = 0;
        for (int k = 0; k < kD; ++k) {
          x += S[vr * kD + k] * wk[t * kD + k];
          q += S[vr * kD + k] * qe[t * kD + k];
        }
        for (int tp = 0; tp < kC; ++tp) wvv += bf16_to_float(v[tp * kD + vr]) * w[t * kC + tp];
        X[vr * kC + t] = x, WV[vr * kC + t] = wvv, U[vr * kC + t] = wvv - x;
        ref_o[(step * kD + vr) * kC + t] = q;
      }
    for (int vr = 0; vr < kD; ++vr)
      for (int t = 0; t < kC; ++t)
        for (int tp = 0; tp < kC; ++tp) ref_o[(step * kD + vr) * kC + t] += WV[vr * kC + tp] * m[t * kC + tp];
    for (int vr = 0; vr < kD; ++vr)
      for (int k = 0; k < kD; ++k) {
        double acc = S[vr * kD + k] * decay[k];
        for (int t = 0; t < kC; ++t) acc += U[vr * kC + t] * kr[t * kD + k];
        S[vr * kD + k] = acc;
      }
  }
  auto rel = [](const std::vector<double>& ref, const std::vector<float>& got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
    return std::sqrt(num / den);
  };
  const double e_s = rel(S, got_s), e_o = rel(ref_o, got_o);
  std::printf("  [wgmma step] %d steps against fp64: state rel %.2e, out rel %.2e\n", kSteps, e_s, e_o);
  EXPECT_LT(e_s, 1e-2);
  EXPECT_LT(e_o, 1e-2);

  // Timing: one block a head for 96 and 132 heads, 512 steps each, no out stores.
  for (const int blocks : {96, sms_}) {
    float* d_states;
    cudaMalloc(&d_states, sizeof(float) * kD * kD * blocks);
    cudaMemset(d_states, 0, sizeof(float) * kD * kD * blocks);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    wgmma_steps<<<blocks, 256>>>(d_chunk, d_states, nullptr, 64);  // warm-up
    constexpr int kTimed = 512;
    cudaEventRecord(a);
    wgmma_steps<<<blocks, 256>>>(d_chunk, d_states, nullptr, kTimed);
    cudaEventRecord(b);
    ASSERT_EQ(cudaEventSynchronize(b), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    std::printf("  [wgmma step] %d blocks x %d steps: %.3f ms, %.3f us a step (8x1 mma.sync step at P1: ~1.34 us)\n",
                blocks, kTimed, ms, 1000.0 * ms / kTimed);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(d_states);
  }
  cudaFree(d_chunk);
  cudaFree(d_state);
  cudaFree(d_out);
}

}  // namespace
}  // namespace flashkda::testing
