// Probe (a measurement for docs/perf-notes.md, not a benchmark of results): the fp16 chunk step
// (gpu/prefill/state_step_f16.cuh) against the tf32 one (state_step.cuh's chunk_step, the 8x1
// layout's C order) on the same chunk, before any kernel takes the fp16 form. One chunk of random
// q, k, v, g, beta is turned into both records on the host (the contract's chunk form, as
// tools/numerics does it), copied into shared memory once, and each block runs `steps` steps of
// it on 8 warps (one head: 128 value rows) from the same random initial state. Prints each step
// form's time a step (CUDA events, median of 5 launches) and the fp16 results' difference from
// fp64 steps on the chunk's exact operands, and from each other (final state and the last
// chunk's out, rel = ||a - b|| / ||b||; tools/numerics models both forms ~1.7e-3 from the oracle).
//
//   f16_step_probe [blocks, 96] [steps, 512]
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

#include "gpu/prefill/state_step_f16.cuh"

namespace {

using namespace flashkda::gpu;
using namespace flashkda::gpu::state_pass;

constexpr int kC = kChunk, kD = kHeadDim;
constexpr uint32_t kStageMax = ChunkRecord::kBytes + kVRowBytes;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

template <bool kF16>
__global__ void __launch_bounds__(256, 1)
    step_loop(const uint8_t* stage_g, uint32_t stage_bytes, const float* s0, float* s_out, uint16_t* out, int steps) {
  extern __shared__ __align__(128) uint8_t stage[];
  for (uint32_t i = threadIdx.x; i < stage_bytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(stage)[i] = reinterpret_cast<const uint4*>(stage_g)[i];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, vbase = warp * 16;
  const int64_t head = int64_t{blockIdx.x} * kD;  // the block's state rows and out columns
  uint16_t* out_head = out + int64_t{blockIdx.x} * kD;
  const int64_t out_stride = int64_t{gridDim.x} * kD;
  float acc[kNTiles][4];
  load_state<StateOrder::kC>(acc, s0, true, vbase, 0, lane);
  if constexpr (kF16) {
    RowScale sc;
    init_row_scale(acc, sc);
    F16LaneOffsets o;
    o.init(lane);
#pragma unroll 1
    for (int c = 0; c < steps; ++c) chunk_step_f16(acc, sc, stage, o, vbase, lane, out_head, kC, out_stride);
    unscale_rows(acc, sc);
  } else {
    LaneOffsets o;
    o.init<kNTiles>(lane, 0);
#pragma unroll 1
    for (int c = 0; c < steps; ++c)
      chunk_step<StateOrder::kC, 1>(acc, stage, o, vbase, 0, lane, static_cast<SliceExchange<1>*>(nullptr), 0, out_head,
                                    kC, out_stride);
  }
  store_state<StateOrder::kC>(acc, s_out, true, head + vbase, 0, lane);
}

float tf32(float x) {  // cvt.rna.tf32.f32
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}
uint16_t bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint32_t f16x2(float lo, float hi) {
  return uint32_t{__half_as_ushort(__float2half_rn(lo))} | uint32_t{__half_as_ushort(__float2half_rn(hi))} << 16;
}
template <typename T>
void put(std::vector<uint8_t>& s, uint32_t at, T x) {
  std::memcpy(s.data() + at, &x, sizeof(T));
}

// The chunk's operands (docs/contract.md's chunk form, safe gate, lower bound -5), fp64.
struct Chunk {
  double Wk[kC][kD], Qe[kC][kD], Kr[kC][kD], W[kC][kC], M[kC][kC], decay[kD];
  float v[kC][kD];  // bf16 values
};

Chunk make_chunk(std::mt19937& rng) {
  std::normal_distribution<double> n01;
  std::uniform_real_distribution<double> u01;
  Chunk ch{};
  double q[kC][kD], k[kC][kD], G[kC][kD], beta[kC];
  const double A = std::exp(u01(rng));
  std::vector<double> bias(kD);
  for (double& b : bias) b = u01(rng);
  for (int t = 0; t < kC; ++t) {
    double nq = 1e-6, nk = 1e-6;
    for (int i = 0; i < kD; ++i) {
      q[t][i] = bf16_value(bf16(static_cast<float>(n01(rng))));
      k[t][i] = bf16_value(bf16(static_cast<float>(n01(rng))));
      ch.v[t][i] = bf16_value(bf16(static_cast<float>(n01(rng))));
      nq += q[t][i] * q[t][i], nk += k[t][i] * k[t][i];
      const double a = -5.0 / (1.0 + std::exp(-A * (n01(rng) + bias[i])));
      G[t][i] = (t ? G[t - 1][i] : 0.0) + a;
    }
    for (int i = 0; i < kD; ++i) q[t][i] *= std::pow(kD, -0.5) / std::sqrt(nq), k[t][i] /= std::sqrt(nk);
    beta[t] = 1.0 / (1.0 + std::exp(-n01(rng)));
  }
  double L[kC][kC] = {}, Kt[kC][kD], Qt[kC][kD];
  for (int t = 0; t < kC; ++t)
    for (int i = 0; i < kD; ++i) Kt[t][i] = k[t][i] * std::exp(G[t][i]), Qt[t][i] = q[t][i] * std::exp(G[t][i]);
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j <= i; ++j) {
      double l = 0.0, m = 0.0;
      for (int c = 0; c < kD; ++c) {
        const double e = std::exp(-G[j][c]) * k[j][c];
        l += Kt[i][c] * e, m += Qt[i][c] * e;
      }
      if (j < i) L[i][j] = beta[i] * l;
      ch.M[i][j] = m;
    }
  for (int j = 0; j < kC; ++j) {  // W = (I + L)^-1 Diag(beta), column j by forward substitution
    double x[kC];
    for (int i = 0; i < kC; ++i) {
      double s = i == j ? 1.0 : 0.0;
      for (int m = 0; m < i; ++m) s -= L[i][m] * x[m];
      x[i] = s;
    }
    for (int i = 0; i < kC; ++i) ch.W[i][j] = x[i] * beta[j];
  }
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) {
      double wk = 0.0;
      for (int s = 0; s < kC; ++s) wk += ch.W[t][s] * Kt[s][c];
      ch.Wk[t][c] = wk;
      ch.Kr[t][c] = k[t][c] * std::exp(G[kC - 1][c] - G[t][c]);
    }
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) {
      double mw = 0.0;
      for (int s = 0; s < kC; ++s) mw += ch.M[t][s] * ch.Wk[s][c];
      ch.Qe[t][c] = Qt[t][c] - mw;
    }
  for (int c = 0; c < kD; ++c) ch.decay[c] = std::exp(G[kC - 1][c]);
  return ch;
}

// The small fields and the v rows, laid out alike in both records (base: the record's kW).
template <typename Record>
void put_common(std::vector<uint8_t>& s, const Chunk& ch) {
  for (int i = 0; i < kC; ++i)
    for (int j = 0; j < kC; ++j) {
      put(s, Record::kW + 4 * swizzle_16(i, j), static_cast<float>(ch.W[i][j]));
      put(s, Record::kM + 4 * swizzle_16(i, j), tf32(static_cast<float>(ch.M[i][j])));
    }
  for (int c = 0; c < kD; ++c) put(s, Record::kDecay + 4 * c, static_cast<float>(ch.decay[c]));
  for (int t = 0; t < kC; ++t)
    for (int c = 0; c < kD; ++c) put(s, Record::kBytes + 2 * (t * kVRowStride + c), bf16(ch.v[t][c]));
}

// ChunkRecord's fragment order (chunk_record.cuh), as the prep kernel stores it.
std::vector<uint8_t> tf32_stage(const Chunk& ch) {
  std::vector<uint8_t> s(ChunkRecord::kBytes + kVRowBytes, 0);
  for (int r = 0; r < 2; ++r)
    for (int nt = 0; nt < 16; ++nt)
      for (int lane = 0; lane < 32; ++lane) {
        const int t = lane / 4 + 8 * r, c = 8 * nt + 2 * (lane % 4);
        const uint32_t e = fragment_entry(16 * r + nt, lane, 8);
        put(s, ChunkRecord::kWk + e, tf32(static_cast<float>(ch.Wk[t][c])));
        put(s, ChunkRecord::kWk + e + 4, tf32(static_cast<float>(ch.Wk[t][c + 1])));
        put(s, ChunkRecord::kQe + fragment_entry(16 * r + nt, lane, 4), bf16(static_cast<float>(ch.Qe[t][c])));
        put(s, ChunkRecord::kQe + fragment_entry(16 * r + nt, lane, 4) + 2, bf16(static_cast<float>(ch.Qe[t][c + 1])));
        // Kr: channel tile nt, token half r: channel 8 nt + g, tokens 8 r + 2 t4, + 1
        const int kc = 8 * nt + lane / 4, kt = 8 * r + 2 * (lane % 4);
        const uint32_t ke = fragment_entry(2 * nt + r, lane, 8);
        put(s, ChunkRecord::kKr + ke, tf32(static_cast<float>(ch.Kr[kt][kc])));
        put(s, ChunkRecord::kKr + ke + 4, tf32(static_cast<float>(ch.Kr[kt + 1][kc])));
      }
  put_common<ChunkRecord>(s, ch);
  return s;
}

// F16Record's (chunk_record.cuh), through the offsets the prep kernel would use.
std::vector<uint8_t> f16_stage(const Chunk& ch) {
  std::vector<uint8_t> s(F16Record::kBytes + kVRowBytes, 0);
  for (int r = 0; r < 2; ++r)
    for (int nt = 0; nt < 16; ++nt)
      for (int lane = 0; lane < 32; ++lane) {
        const int t = lane / 4 + 8 * r, c = 8 * nt + 2 * (lane % 4);
        put(s, F16Record::pair(F16Record::kWk, nt, r, lane),
            f16x2(tf32(static_cast<float>(ch.Wk[t][c])), tf32(static_cast<float>(ch.Wk[t][c + 1]))));
        put(s, F16Record::pair(F16Record::kQe, nt, r, lane),
            f16x2(static_cast<float>(ch.Qe[t][c]), static_cast<float>(ch.Qe[t][c + 1])));
      }
  for (int c = 0; c < kD; ++c)
    for (int t4 = 0; t4 < 4; ++t4) {
      const uint32_t at = F16Record::kr_channel(c) + 8 * t4;
      auto kr = [&](int t) { return static_cast<float>(ch.Kr[t][c]); };
      put(s, at, f16x2(kr(2 * t4), kr(2 * t4 + 1)));
      put(s, at + 4, f16x2(kr(2 * t4 + 8), kr(2 * t4 + 9)));
    }
  put_common<F16Record>(s, ch);
  return s;
}

// The same steps in fp64 on the chunk's exact operands: S [V][K] from s0; returns the final
// state and the last step's out rows [C][V].
void reference(const Chunk& ch, const std::vector<float>& s0, int steps, std::vector<double>& S,
               std::vector<double>& O) {
  S.assign(s0.begin(), s0.end());
  O.assign(size_t{kC} * kD, 0.0);
  std::vector<double> wv(size_t{kC} * kD), u(size_t{kC} * kD);
  for (int t = 0; t < kC; ++t)
    for (int v = 0; v < kD; ++v) {
      double x = 0.0;
      for (int s = 0; s < kC; ++s) x += ch.W[t][s] * ch.v[s][v];
      wv[t * kD + v] = x;
    }
  for (int step = 0; step < steps; ++step) {
    for (int t = 0; t < kC; ++t)
      for (int v = 0; v < kD; ++v) {
        double x = 0.0, p = 0.0;
        for (int c = 0; c < kD; ++c) x += ch.Wk[t][c] * S[v * kD + c], p += ch.Qe[t][c] * S[v * kD + c];
        for (int s = 0; s <= t; ++s) p += ch.M[t][s] * wv[s * kD + v];
        u[t * kD + v] = wv[t * kD + v] - x;
        O[t * kD + v] = p;
      }
    for (int v = 0; v < kD; ++v)
      for (int c = 0; c < kD; ++c) {
        double x = S[v * kD + c] * ch.decay[c];
        for (int t = 0; t < kC; ++t) x += u[t * kD + v] * ch.Kr[t][c];
        S[v * kD + c] = x;
      }
  }
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0.0, n = 0.0;
  for (size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]), n += b[i] * b[i];
  return std::sqrt(d / n);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int blocks = argc > 1 ? std::atoi(argv[1]) : 96;
    const int steps = argc > 2 ? std::atoi(argv[2]) : 512;
    std::mt19937 rng(1);
    const Chunk ch = make_chunk(rng);
    const std::vector<uint8_t> stages[2] = {tf32_stage(ch), f16_stage(ch)};
    std::vector<float> s0(kD * kD);
    std::normal_distribution<float> n01;
    for (float& x : s0) x = n01(rng);

    uint8_t* d_stage;
    float *d_s0, *d_s;
    uint16_t* d_out;
    check(cudaMalloc(&d_stage, kStageMax), "cudaMalloc");
    check(cudaMalloc(&d_s0, s0.size() * 4), "cudaMalloc");
    check(cudaMalloc(&d_s, size_t{2} * blocks * kD * kD * 4), "cudaMalloc");
    check(cudaMalloc(&d_out, size_t{2} * blocks * kC * kD * 2), "cudaMalloc");
    check(cudaMemcpy(d_s0, s0.data(), s0.size() * 4, cudaMemcpyHostToDevice), "copy");
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    std::vector<double> state[2], out[2];
    for (int f = 0; f < 2; ++f) {
      const auto kernel = f ? step_loop<true> : step_loop<false>;
      const uint32_t bytes = static_cast<uint32_t>(stages[f].size());
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageMax), "smem attribute");
      check(cudaMemcpy(d_stage, stages[f].data(), bytes, cudaMemcpyHostToDevice), "copy");
      float* s_f = d_s + static_cast<size_t>(f) * blocks * kD * kD;
      uint16_t* out_f = d_out + static_cast<size_t>(f) * blocks * kC * kD;
      check(cudaMemset(s_f, 0xff, static_cast<size_t>(blocks) * kD * kD * 4), "poison");  // NaN until written
      std::vector<float> times;
      for (int rep = 0; rep < 6; ++rep) {  // the first a warm-up
        check(cudaEventRecord(e0), "record");
        kernel<<<blocks, 256, kStageMax>>>(d_stage, bytes, d_s0, s_f, out_f, steps);
        check(cudaEventRecord(e1), "record");
        check(cudaEventSynchronize(e1), "step loop");
        float ms = 0.0f;
        check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
        if (rep > 0) times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      std::printf("%s step: %.3f us a step (%d blocks, %d steps, median of %zu launches)\n", f ? "fp16" : "tf32",
                  1e3 * times[times.size() / 2] / steps, blocks, steps, times.size());
      std::vector<float> s_host(kD * kD);  // block 0's final state and its last out rows
      std::vector<uint16_t> o_host(size_t{kC} * blocks * kD);
      check(cudaMemcpy(s_host.data(), s_f, s_host.size() * 4, cudaMemcpyDeviceToHost), "copy");
      check(cudaMemcpy(o_host.data(), out_f, o_host.size() * 2, cudaMemcpyDeviceToHost), "copy");
      state[f].assign(s_host.begin(), s_host.end());
      for (int t = 0; t < kC; ++t)
        for (int v = 0; v < kD; ++v) out[f].push_back(bf16_value(o_host[static_cast<size_t>(t) * blocks * kD + v]));
    }
    std::vector<double> ref_state, ref_out;
    reference(ch, s0, steps, ref_state, ref_out);
    for (int f = 0; f < 2; ++f)
      std::printf("%s against fp64: final state rel %.3e, last out rows rel %.3e\n", f ? "fp16" : "tf32",
                  rel(state[f], ref_state), rel(out[f], ref_out));
    std::printf("fp16 against tf32: final state rel %.3e, last out rows rel %.3e\n", rel(state[1], state[0]),
                rel(out[1], out[0]));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "f16_step_probe: %s\n", e.what());
    return 1;
  }
}
