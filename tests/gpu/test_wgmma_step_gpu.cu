// The wgmma state pass's chunk step (gpu/prefill/state_wgmma_step.cuh) alone, on chunks of 16
// tokens (the pass's) and 32 (a measurement toward a larger chunk: each wgmma gets twice the work
// a step for the same chain of dependent products): a record image in WgmmaRecordOf<C>'s layout
// built on the host from known matrices, the step run on it by two warpgroups (one head),
// checked against fp64 over several chunks (out rows and the state), with a partial chunk whose
// rows past the end hold NaN (they must be ignored and left unwritten); then timed with the
// chunk fixed in shared memory (no copies), the step's own time a chunk, comparable to the 8x1
// mma.sync step (~1.31 us a 16-token chunk at P1, docs/perf-notes.md).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "gpu/prefill/state_step.cuh"
#include "gpu/prefill/state_wgmma_step.cuh"
#include "sm90_device.h"

namespace flashkda::testing {
namespace {

constexpr int kD = 128;
// The record, then the chunk's v rows (kVRowStride elements apart).
template <int kC>
constexpr uint32_t kImageBytes = gpu::WgmmaRecordOf<kC>::kBytes + kC * gpu::kVRowStride * 2;

// Runs `steps` chunks of kC tokens on one head: state_io [128 v][128 k] fp32 in and out; out
// [steps][kC][128] bf16 (row t of chunk c, value column v), written where t < count.
template <int kC>
__global__ void __launch_bounds__(256, 1) run_steps(const uint8_t* image, float* state_io, uint16_t* out, int steps,
                                                    int count) {
  extern __shared__ __align__(128) uint8_t sm[];
  for (uint32_t i = threadIdx.x; i < kImageBytes<kC> / 16; i += 256)
    reinterpret_cast<uint4*>(sm)[i] = reinterpret_cast<const uint4*>(image)[i];
  ptx::fence_proxy_async_shared();  // ordinary stores, read by wgmma (the async proxy)
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vbase = 64 * (warp / 4) + 16 * (warp % 4);
  float acc[gpu::state_pass::kNTiles][4];
  using gpu::state_pass::StateOrder;  // C order: wgmma's accumulator holds C fragments
  gpu::state_pass::load_state<StateOrder::kC>(acc, state_io, true, vbase, 0, lane);
  float(&s)[64] = reinterpret_cast<float(&)[64]>(acc);
  for (int c = 0; c < steps; ++c) gpu::state_pass::wgmma_chunk_step<kC>(s, sm, vbase, lane, out + c * kC * kD, count, kD);
  gpu::state_pass::store_state<StateOrder::kC>(acc, state_io, true, vbase, 0, lane);
}

class GpuWgmmaStep : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = sm90_unavailable("wgmma step"); !why.empty()) GTEST_SKIP() << why;
  }
};

float tf32_round(float x) {  // the nearest tf32 (ties away from zero), as the prep kernel rounds
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

template <int kC>
struct Chunk {
  std::vector<float> wk, qe, kr, w, m, decay;  // [t][k], [t][k], [t][k], [t][t'], [t][t'], [k]
  std::vector<uint16_t> v;                     // [t][v] bf16
};

template <int kC>
Chunk<kC> random_chunk(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> small(-0.1f, 0.1f), unit(-1.0f, 1.0f), dec(0.9f, 1.0f);
  Chunk<kC> c;
  c.wk.resize(kC * kD), c.qe.resize(kC * kD), c.kr.resize(kC * kD), c.w.resize(kC * kC), c.m.resize(kC * kC);
  c.decay.resize(kD), c.v.resize(kC * kD);
  for (float& x : c.wk) x = tf32_round(small(rng));
  for (float& x : c.qe) x = tf32_round(small(rng));
  for (float& x : c.kr) x = tf32_round(small(rng));
  for (int i = 0; i < kC * kC; ++i) {
    c.w[i] = (i / kC >= i % kC) ? 5 * small(rng) : 0.0f;  // lower triangular, as W is
    c.m[i] = (i / kC >= i % kC) ? tf32_round(small(rng)) : 0.0f;
  }
  for (float& x : c.decay) x = dec(rng);
  for (uint16_t& x : c.v) x = float_to_bf16(unit(rng));
  return c;
}

// The image the prep kernel would write (WgmmaRecordOf<kC>'s element offsets), the v rows after
// it; v rows from `count` on hold NaN (the next sequence's rows, or garbage, to be ignored).
template <int kC>
std::vector<uint8_t> image_of(const Chunk<kC>& c, int count) {
  using WgmmaRecord = gpu::WgmmaRecordOf<kC>;
  std::vector<uint8_t> img(kImageBytes<kC>, 0);
  auto put = [&](uint32_t off, float x) { std::memcpy(img.data() + off, &x, 4); };
  for (int t = 0; t < kC; ++t)
    for (int k = 0; k < kD; ++k) {
      put(WgmmaRecord::wk(t, k), c.wk[t * kD + k]);
      put(WgmmaRecord::qe(t, k), c.qe[t * kD + k]);
      put(WgmmaRecord::kr(t, k), c.kr[t * kD + k]);
    }
  for (int t = 0; t < kC; ++t)
    for (int tp = 0; tp < kC; ++tp) {
      const float w = c.w[t * kC + tp], hi = tf32_round(w);
      put(WgmmaRecord::w(0, t, tp), hi);
      put(WgmmaRecord::w(1, t, tp), w - hi);
      put(WgmmaRecord::m(t, tp), c.m[t * kC + tp]);
    }
  for (int k = 0; k < kD; ++k) put(WgmmaRecord::kDecay + 4 * k, c.decay[k]);
  const uint16_t nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  for (int t = 0; t < kC; ++t)
    for (int v = 0; v < kD; ++v) {
      const uint16_t x = t < count ? c.v[t * kD + v] : nan;
      std::memcpy(img.data() + WgmmaRecord::kBytes + 2 * (t * gpu::kVRowStride + v), &x, 2);
    }
  return img;
}

// fp64: `steps` chunks from S^T (updated in place); out [steps][16][128] for t < count.
template <int kC>
void reference(const Chunk<kC>& c, int count, int steps, std::vector<double>& S, std::vector<double>& out) {
  out.assign(static_cast<size_t>(steps) * kC * kD, 0.0);
  for (int step = 0; step < steps; ++step) {
    std::vector<double> WV(kD * kC), U(kD * kC);
    for (int v = 0; v < kD; ++v)
      for (int t = 0; t < kC; ++t) {
        double x = 0, q = 0, wv = 0;
        for (int k = 0; k < kD; ++k) {
          x += S[v * kD + k] * c.wk[t * kD + k];
          q += S[v * kD + k] * c.qe[t * kD + k];
        }
        for (int tp = 0; tp < count; ++tp) wv += bf16_to_float(c.v[tp * kD + v]) * c.w[t * kC + tp];
        WV[v * kC + t] = wv, U[v * kC + t] = wv - x;
        out[(static_cast<size_t>(step) * kC + t) * kD + v] = q;
      }
    for (int v = 0; v < kD; ++v)
      for (int t = 0; t < kC; ++t)
        for (int tp = 0; tp < kC; ++tp)
          out[(static_cast<size_t>(step) * kC + t) * kD + v] += WV[v * kC + tp] * c.m[t * kC + tp];
    for (int v = 0; v < kD; ++v)
      for (int k = 0; k < kD; ++k) {
        double acc = S[v * kD + k] * c.decay[k];
        for (int t = 0; t < kC; ++t) acc += U[v * kC + t] * c.kr[t * kD + k];
        S[v * kD + k] = acc;
      }
  }
}

double rel(const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
  return std::sqrt(num / den);
}

template <int kC>
void expect_steps_match_fp64() {
  for (const int count : {kC, kC - 5}) {
    SCOPED_TRACE(::testing::Message() << count << " tokens a chunk");
    constexpr int kSteps = 6;
    const Chunk<kC> c = random_chunk<kC>(5 + count);
    const std::vector<uint8_t> img = image_of<kC>(c, count);
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<float> s0(kD * kD);
    for (float& x : s0) x = unit(rng);
    uint8_t* d_img;
    float* d_state;
    uint16_t* d_out;
    cudaMalloc(&d_img, kImageBytes<kC>);
    cudaMalloc(&d_state, sizeof(float) * kD * kD);
    cudaMalloc(&d_out, 2 * kSteps * kC * kD);
    cudaMemcpy(d_img, img.data(), kImageBytes<kC>, cudaMemcpyHostToDevice);
    cudaMemcpy(d_state, s0.data(), sizeof(float) * kD * kD, cudaMemcpyHostToDevice);
    cudaMemset(d_out, 0xFF, 2 * kSteps * kC * kD);  // poison: rows t >= count must stay so
    ASSERT_EQ(cudaFuncSetAttribute(run_steps<kC>, cudaFuncAttributeMaxDynamicSharedMemorySize, kImageBytes<kC>),
              cudaSuccess);
    run_steps<kC><<<1, 256, (kImageBytes<kC>)>>>(d_img, d_state, d_out, kSteps, count);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got_s(kD * kD);
    std::vector<uint16_t> got_o(kSteps * kC * kD);
    cudaMemcpy(got_s.data(), d_state, sizeof(float) * kD * kD, cudaMemcpyDeviceToHost);
    cudaMemcpy(got_o.data(), d_out, 2 * kSteps * kC * kD, cudaMemcpyDeviceToHost);
    cudaFree(d_img);
    cudaFree(d_state);
    cudaFree(d_out);

    std::vector<double> S(s0.begin(), s0.end()), ref_o;
    reference(c, count, kSteps, S, ref_o);
    std::vector<double> gs(got_s.begin(), got_s.end()), go, ro;
    for (int step = 0; step < kSteps; ++step)
      for (int t = 0; t < kC; ++t)
        for (int v = 0; v < kD; ++v) {
          const size_t i = (static_cast<size_t>(step) * kC + t) * kD + v;
          if (t < count) {
            go.push_back(bf16_to_float(got_o[i]));
            ro.push_back(ref_o[i]);
          } else {
            ASSERT_EQ(got_o[i], 0xFFFF) << "out row " << t << " past the chunk's end was written";
          }
        }
    const double e_s = rel(S, gs), e_o = rel(ro, go);
    std::printf("  [wgmma step] %d-token chunks, %d tokens, %d chunks against fp64: state rel %.2e, out rel %.2e\n", kC,
                count, kSteps, e_s, e_o);
    EXPECT_LT(e_s, 1e-2);  // tf32 products and bf16 out: ~1e-3; a wrong fragment or descriptor: O(1)
    EXPECT_LT(e_o, 1e-2);
  }
}

template <int kC>
void time_a_chunk() {
  const std::vector<uint8_t> img = image_of<kC>(random_chunk<kC>(3), kC);
  uint8_t* d_img;
  float* d_states;
  uint16_t* d_out;
  constexpr int kBlocks = 96, kTimed = 8192 / kC;  // P1's heads, P1's tokens
  cudaMalloc(&d_img, kImageBytes<kC>);
  cudaMalloc(&d_states, sizeof(float) * kD * kD);
  cudaMalloc(&d_out, 2 * kTimed * kC * kD);
  cudaMemcpy(d_img, img.data(), kImageBytes<kC>, cudaMemcpyHostToDevice);
  cudaMemset(d_states, 0, sizeof(float) * kD * kD);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  ASSERT_EQ(cudaFuncSetAttribute(run_steps<kC>, cudaFuncAttributeMaxDynamicSharedMemorySize, kImageBytes<kC>),
            cudaSuccess);
  run_steps<kC><<<kBlocks, 256, (kImageBytes<kC>)>>>(d_img, d_states, d_out, 64, kC);  // warm-up
  cudaEventRecord(a);
  run_steps<kC><<<kBlocks, 256, (kImageBytes<kC>)>>>(d_img, d_states, d_out, kTimed, kC);  // every block the same head: timing only
  cudaEventRecord(b);
  ASSERT_EQ(cudaEventSynchronize(b), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  std::printf("  [wgmma step] %d-token chunks, %d blocks x %d chunks: %.3f ms, %.3f us a chunk, %.3f us a 16 tokens "
              "(8x1 mma.sync step at P1: ~1.31 us a 16 tokens)\n",
              kC, kBlocks, kTimed, ms, 1000.0 * ms / kTimed, 1000.0 * ms / kTimed * 16 / kC);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(d_img);
  cudaFree(d_states);
  cudaFree(d_out);
}

TEST_F(GpuWgmmaStep, MatchesFp64FullAndPartialChunks) { expect_steps_match_fp64<16>(); }
TEST_F(GpuWgmmaStep, ThirtyTwoTokenChunksMatchFp64) { expect_steps_match_fp64<32>(); }
TEST_F(GpuWgmmaStep, TimeAChunk) { time_a_chunk<16>(); }
TEST_F(GpuWgmmaStep, TimeAThirtyTwoTokenChunk) { time_a_chunk<32>(); }

}  // namespace
}  // namespace flashkda::testing
