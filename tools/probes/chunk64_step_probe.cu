// Probe (a measurement for docs/perf-notes.md, not a benchmark of results): the state chain of a
// fused chunk-64 prefill on wgmma with fp16 operands, before any kernel is built around it. The
// question it answers: how long one 64-token step of a head takes on the tensor cores when the
// operands are already in shared memory, at the block count of P1 (96 heads, one block a head).
//
// One block is one head: two warpgroups, each owning 64 value rows of S^T in fp32 registers
// (an m64n128 accumulator). A step, with the chunk's operands in shared memory:
//   X^T = S^T Wk^T, P^T = S^T Qt^T       m64n64k16 x 8 each, A = fp16(S^T) from registers
//   U^T = WV^T - X^T                      fp32, WV^T read from shared memory in D order
//   S^T = S^T D + U^T Kr                   m64n128k16 x 4, A = fp16(U^T)
//   O^T = P^T + U^T M^T                    m64n64k16 x 4, into P's accumulator
//   out rows (bf16) through a shared-memory tile, 16-byte stores to device memory
// (O = Qt S + M U and U = W V - Wk S are the chunk form of docs/contract.md with Wk = W Kt.)
// Not modelled: the per-row scale that keeps fp16(S^T) in range for any state (the fp16 step's
// RowScale), and the prep work that would build the operands beside the chain.
//
// One random chunk (safe gate, lower bound -5) is turned into the operands in fp64 on the host;
// every block runs `steps` steps of it from its own random S0. Prints the time a step (CUDA events,
// median of 5 launches) and, for a 3-step launch, block 0's final state and last out against the
// same 3 steps in fp64 (rel = ||gpu - ref|| / ||ref||).
//
//   chunk64_step_probe [blocks, 96] [steps, 128]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/prefill/fused_config.h"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/wgmma_f16.cuh"

namespace {

using namespace flashkda;

constexpr int kC = 64, kD = 128;
// Shared-memory image of a chunk's operands. The fp16 tiles are wgmma B operands [rows][cols]
// K-major without swizzle: core matrix (rows 8 rb.., cols 8 cb..) at (rb * cols / 8 + cb) * 128.
constexpr uint32_t kWk = 0;                 // Wk [64 tokens][128 channels]
constexpr uint32_t kQt = kWk + kC * kD * 2;  // Qt [64 tokens][128 channels]
constexpr uint32_t kKrT = kQt + kC * kD * 2;  // Kr^T [128 channels][64 tokens]
constexpr uint32_t kM = kKrT + kC * kD * 2;  // M [64 tokens i][64 tokens j]
constexpr uint32_t kWV = kM + kC * kC * 2;  // W V, fp32, in each thread's D order (float4 a lane)
constexpr uint32_t kDecay = kWV + kC * kD * 4;  // exp(G_C) [128] fp32
constexpr uint32_t kStageBytes = kDecay + kD * 4;
constexpr int kOutPitch = kD + 8;  // out tile row pitch (bf16): spreads a warp's 2-byte stores over banks
constexpr uint32_t kOutTile = kC * kOutPitch * 2;
constexpr uint32_t kSmemBytes = kStageBytes + 2 * kOutTile;

using gpu::fused::tile_offset;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

__device__ __forceinline__ void named_barrier(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

__global__ void __launch_bounds__(256, 1)
    chain_loop(const uint8_t* stage_g, const float* s0, float* s_out, uint16_t* out, int steps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (uint32_t i = threadIdx.x; i < kStageBytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = reinterpret_cast<const uint4*>(stage_g)[i];
  ptx::fence_proxy_async_shared();
  __syncthreads();

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row = 64 * wg + 16 * warp + g;  // this thread's value rows: row, row + 8
  const float* s0b = s0 + size_t{blockIdx.x} * kD * kD;
  float s[64];  // S^T [row, row + 8][8 j + 2t, +1], j < 16
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 x = *reinterpret_cast<const float2*>(s0b + (row + 8 * r) * kD + 8 * j + 2 * t);
      s[4 * j + 2 * r] = x.x, s[4 * j + 2 * r + 1] = x.y;
    }
  const uint64_t d_wk = ptx::smem_matrix_desc(smem + kWk, 128, kD * 16);
  const uint64_t d_qt = ptx::smem_matrix_desc(smem + kQt, 128, kD * 16);
  const uint64_t d_kr = ptx::smem_matrix_desc(smem + kKrT, 128, kC * 16);
  const uint64_t d_m = ptx::smem_matrix_desc(smem + kM, 128, kC * 16);
  const float4* wv = reinterpret_cast<const float4*>(smem + kWV) + (wg * 4 + warp) * 8 * 32 + lane;
  const float2* decay = reinterpret_cast<const float2*>(smem + kDecay) + t;
  uint16_t* out_b = out + size_t{blockIdx.x} * kD;  // out [steps * 64 tokens][blocks][128]
  const size_t out_pitch = size_t{gridDim.x} * kD;

#pragma unroll 1
  for (int c = 0; c < steps; ++c) {
    uint32_t sa[8][4];
    ptx::f16_a_from_d<8>(s, sa);
    float x[32], p[32];
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(x, sa[ks], ptx::smem_matrix_desc_advance(d_wk, 256 * ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(p, sa[ks], ptx::smem_matrix_desc_advance(d_qt, 256 * ks), ks > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(x);
    ptx::fence_operands(p);

    float u[32];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 w = wv[32 * j];
      u[4 * j] = w.x - x[4 * j], u[4 * j + 1] = w.y - x[4 * j + 1];
      u[4 * j + 2] = w.z - x[4 * j + 2], u[4 * j + 3] = w.w - x[4 * j + 3];
    }
    uint32_t ua[4][4];
    ptx::f16_a_from_d<4>(u, ua);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 dc = decay[4 * j];
      s[4 * j] *= dc.x, s[4 * j + 1] *= dc.y, s[4 * j + 2] *= dc.x, s[4 * j + 3] *= dc.y;
    }
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<128>(s, ua[ks], ptx::smem_matrix_desc_advance(d_kr, 256 * ks), true);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<64>(p, ua[ks], ptx::smem_matrix_desc_advance(d_m, 256 * ks), true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(s);
    ptx::fence_operands(p);

    // out rows: O^T (value row, token col) into the [token][value] tile, then the warpgroup's
    // 64 value columns of each token row to device memory, 16 bytes a thread.
    uint16_t* tile = reinterpret_cast<uint16_t*>(smem + kStageBytes + (c & 1) * kOutTile);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t pr = ptx::pack_bf16x2(p[4 * j + 2 * r], p[4 * j + 2 * r + 1]);
        tile[(8 * j + 2 * t) * kOutPitch + row + 8 * r] = static_cast<uint16_t>(pr);
        tile[(8 * j + 2 * t + 1) * kOutPitch + row + 8 * r] = static_cast<uint16_t>(pr >> 16);
      }
    named_barrier(1 + wg);
    const int tid = threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 16 * i + tid / 8, col = 64 * wg + 8 * (tid % 8);
      *reinterpret_cast<uint4*>(out_b + (size_t{64} * c + tok) * out_pitch + col) =
          *reinterpret_cast<const uint4*>(tile + tok * kOutPitch + col);
    }
  }
  float* so = s_out + size_t{blockIdx.x} * kD * kD;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(so + (row + 8 * r) * kD + 8 * j + 2 * t) = make_float2(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]);
}

float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}
float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
template <typename T>
void put(std::vector<uint8_t>& s, uint32_t at, T x) {
  std::memcpy(s.data() + at, &x, sizeof(T));
}

// One chunk's operands in fp64 (docs/contract.md's chunk form, safe gate, lower bound -5).
struct Chunk {
  std::vector<double> Wk, Qt, Kr, M, WV, decay;  // [C][D], [C][D], [C][D], [C][C], [C][D], [D]
};

Chunk make_chunk(std::mt19937& rng) {
  std::normal_distribution<double> n01;
  std::uniform_real_distribution<double> u01;
  Chunk ch{std::vector<double>(kC * kD), std::vector<double>(kC * kD), std::vector<double>(kC * kD),
           std::vector<double>(kC * kC), std::vector<double>(kC * kD), std::vector<double>(kD)};
  std::vector<double> q(kC * kD), k(kC * kD), v(kC * kD), G(kC * kD), beta(kC), bias(kD);
  const double A = std::exp(u01(rng));
  for (double& b : bias) b = u01(rng);
  for (int t = 0; t < kC; ++t) {
    double nq = 1e-6, nk = 1e-6;
    for (int i = 0; i < kD; ++i) {
      q[t * kD + i] = bf16_round(static_cast<float>(n01(rng)));
      k[t * kD + i] = bf16_round(static_cast<float>(n01(rng)));
      v[t * kD + i] = bf16_round(static_cast<float>(n01(rng)));
      nq += q[t * kD + i] * q[t * kD + i], nk += k[t * kD + i] * k[t * kD + i];
      G[t * kD + i] = (t ? G[(t - 1) * kD + i] : 0.0) - 5.0 / (1.0 + std::exp(-A * (n01(rng) + bias[i])));
    }
    for (int i = 0; i < kD; ++i) q[t * kD + i] *= std::pow(kD, -0.5) / std::sqrt(nq), k[t * kD + i] /= std::sqrt(nk);
    beta[t] = 1.0 / (1.0 + std::exp(-n01(rng)));
  }
  std::vector<double> L(kC * kC, 0.0), Kt(kC * kD), W(kC * kC);
  for (int t = 0; t < kC; ++t)
    for (int i = 0; i < kD; ++i) {
      Kt[t * kD + i] = k[t * kD + i] * std::exp(G[t * kD + i]);
      ch.Qt[t * kD + i] = q[t * kD + i] * std::exp(G[t * kD + i]);
      ch.Kr[t * kD + i] = k[t * kD + i] * std::exp(G[(kC - 1) * kD + i] - G[t * kD + i]);
    }
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j <= i; ++j) {
      double l = 0.0, m = 0.0;
      for (int c = 0; c < kD; ++c) {
        const double e = std::exp(G[i * kD + c] - G[j * kD + c]) * k[j * kD + c];
        l += k[i * kD + c] * e, m += q[i * kD + c] * e;
      }
      if (j < i) L[i * kC + j] = beta[i] * l;
      ch.M[i * kC + j] = m;
    }
  for (int j = 0; j < kC; ++j) {  // W = (I + L)^-1 Diag(beta), column j by forward substitution
    std::vector<double> x(kC);
    for (int i = 0; i < kC; ++i) {
      double s = i == j ? 1.0 : 0.0;
      for (int m = 0; m < i; ++m) s -= L[i * kC + m] * x[m];
      x[i] = s;
    }
    for (int i = 0; i < kC; ++i) W[i * kC + j] = x[i] * beta[j];
  }
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) {
      double wk = 0.0, wv = 0.0;
      for (int s = 0; s < kC; ++s) wk += W[t * kC + s] * Kt[s * kD + c], wv += W[t * kC + s] * v[s * kD + c];
      ch.Wk[t * kD + c] = wk, ch.WV[t * kD + c] = wv;
    }
  for (int c = 0; c < kD; ++c) ch.decay[c] = std::exp(G[(kC - 1) * kD + c]);
  return ch;
}

std::vector<uint8_t> stage_image(const Chunk& ch) {
  std::vector<uint8_t> s(kStageBytes, 0);
  auto h = [](double x) { return __half_as_ushort(__float2half_rn(static_cast<float>(x))); };
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) {
      put(s, kWk + tile_offset(t, c, kD), h(ch.Wk[t * kD + c]));
      put(s, kQt + tile_offset(t, c, kD), h(ch.Qt[t * kD + c]));
      put(s, kKrT + tile_offset(c, t, kC), h(ch.Kr[t * kD + c]));
    }
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j < kC; ++j) put(s, kM + tile_offset(i, j, kC), h(ch.M[i * kC + j]));
  // W V^T in D order: value row v = 64 wg + 16 warp + g (+8), token 8 j + 2 t (+1) at float4
  // ((wg * 4 + warp) * 8 + j) * 32 + lane, components (row, tok), (row, tok + 1), (row + 8, ..).
  for (int wg = 0; wg < 2; ++wg)
    for (int warp = 0; warp < 4; ++warp)
      for (int j = 0; j < 8; ++j)
        for (int lane = 0; lane < 32; ++lane) {
          const int v = 64 * wg + 16 * warp + lane / 4, tok = 8 * j + 2 * (lane % 4);
          const uint32_t at = kWV + 16 * (((wg * 4 + warp) * 8 + j) * 32 + lane);
          const float f[4] = {static_cast<float>(ch.WV[tok * kD + v]), static_cast<float>(ch.WV[(tok + 1) * kD + v]),
                              static_cast<float>(ch.WV[tok * kD + v + 8]), static_cast<float>(ch.WV[(tok + 1) * kD + v + 8])};
          std::memcpy(s.data() + at, f, 16);
        }
  for (int c = 0; c < kD; ++c) put(s, kDecay + 4 * c, static_cast<float>(ch.decay[c]));
  return s;
}

// `steps` steps in fp64 from S0^T [V][K]; returns the last chunk's out [C][V] and leaves S^T in st.
std::vector<double> reference(const Chunk& ch, std::vector<double>& st, int steps) {
  std::vector<double> o(kC * kD);
  for (int step = 0; step < steps; ++step) {
    std::vector<double> u(kC * kD), p(kC * kD);
    for (int t = 0; t < kC; ++t)
      for (int v = 0; v < kD; ++v) {
        double x = 0.0, pp = 0.0;
        for (int c = 0; c < kD; ++c) x += ch.Wk[t * kD + c] * st[v * kD + c], pp += ch.Qt[t * kD + c] * st[v * kD + c];
        u[t * kD + v] = ch.WV[t * kD + v] - x, p[t * kD + v] = pp;
      }
    for (int i = 0; i < kC; ++i)
      for (int v = 0; v < kD; ++v) {
        double mu = 0.0;
        for (int j = 0; j < kC; ++j) mu += ch.M[i * kC + j] * u[j * kD + v];
        o[i * kD + v] = p[i * kD + v] + mu;
      }
    for (int v = 0; v < kD; ++v)
      for (int c = 0; c < kD; ++c) {
        double upd = 0.0;
        for (int t = 0; t < kC; ++t) upd += u[t * kD + v] * ch.Kr[t * kD + c];
        st[v * kD + c] = st[v * kD + c] * ch.decay[c] + upd;
      }
  }
  return o;
}

double rel(const std::vector<double>& ref, const std::vector<double>& x) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) num += (x[i] - ref[i]) * (x[i] - ref[i]), den += ref[i] * ref[i];
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) try {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 96, steps = argc > 2 ? std::atoi(argv[2]) : 128;
  std::mt19937 rng(7);
  const Chunk ch = make_chunk(rng);
  const std::vector<uint8_t> image = stage_image(ch);
  std::normal_distribution<float> n01;
  std::vector<float> s0(static_cast<size_t>(blocks) * kD * kD);
  for (float& x : s0) x = n01(rng);

  uint8_t* d_stage;
  float *d_s0, *d_s;
  uint16_t* d_out;
  check(cudaMalloc(&d_stage, kStageBytes), "cudaMalloc");
  check(cudaMalloc(&d_s0, s0.size() * 4), "cudaMalloc");
  check(cudaMalloc(&d_s, s0.size() * 4), "cudaMalloc");
  check(cudaMalloc(&d_out, static_cast<size_t>(steps) * kC * blocks * kD * 2), "cudaMalloc");
  check(cudaMemcpy(d_stage, image.data(), kStageBytes, cudaMemcpyHostToDevice), "copy");
  check(cudaMemcpy(d_s0, s0.data(), s0.size() * 4, cudaMemcpyHostToDevice), "copy");
  check(cudaFuncSetAttribute(chain_loop, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "attribute");

  // Accuracy: 3 steps, block 0 against fp64.
  const int check_steps = 3;
  chain_loop<<<blocks, 256, kSmemBytes>>>(d_stage, d_s0, d_s, d_out, check_steps);
  check(cudaDeviceSynchronize(), "check launch");
  std::vector<float> s_gpu(kD * kD);
  std::vector<uint16_t> o_gpu(static_cast<size_t>(check_steps) * kC * blocks * kD);
  check(cudaMemcpy(s_gpu.data(), d_s, kD * kD * 4, cudaMemcpyDeviceToHost), "copy back");
  check(cudaMemcpy(o_gpu.data(), d_out, o_gpu.size() * 2, cudaMemcpyDeviceToHost), "copy back");
  std::vector<double> st(s0.begin(), s0.begin() + kD * kD);
  const std::vector<double> o_ref = reference(ch, st, check_steps);
  std::vector<double> s_g(s_gpu.begin(), s_gpu.end()), o_g(kC * kD);
  for (int t = 0; t < kC; ++t)
    for (int v = 0; v < kD; ++v)
      o_g[t * kD + v] = bf16_value(o_gpu[(size_t{kC} * (check_steps - 1) + t) * blocks * kD + v]);
  std::printf("chunk64 step, %d steps from a random S0, block 0 against fp64: state rel %.3e, last out rel %.3e\n",
              check_steps, rel(st, s_g), rel(o_ref, o_g));

  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<float> ms;
  for (int rep = 0; rep < 6; ++rep) {
    check(cudaEventRecord(e0), "record");
    chain_loop<<<blocks, 256, kSmemBytes>>>(d_stage, d_s0, d_s, d_out, steps);
    check(cudaEventRecord(e1), "record");
    check(cudaEventSynchronize(e1), "sync");
    float t;
    check(cudaEventElapsedTime(&t, e0, e1), "elapsed");
    if (rep > 0) ms.push_back(t);  // the first launch warms up
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  std::printf("chunk64 step: %d blocks x %d steps: %.3f ms a launch (median of %zu), %.3f us a 64-token step\n", blocks,
              steps, med, ms.size(), 1e3 * med / steps);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "chunk64_step_probe: %s\n", e.what());
  return 1;
}
