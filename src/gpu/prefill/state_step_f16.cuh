// The chunk step on fp16 tensor-core products (m16n8k16), for one warp owning 16 value rows and
// all 128 key channels (the KS = 1 layouts). Compiled only so far: no kernel takes it yet
// (docs/perf-notes.md, "fp16 as the state step's MMA type", has the design and its numerics).
//
// fp16 has tf32's 11 significant bits but not its range, so each state row v carries a power of
// two (RowScale): the registers hold S^ = S 2^-e_v in fp32 and the products read fp16(S^):
//   X^ = S^ Wk^T,  P^ = S^ Qe^T,  U^ = W V 2^-e_v - X^,  O = P^ 2^e_v + W V M^T,
//   S^ = D S^ + fp16(U^) Kr.
// A bound B_v >= max |S^_v| grows by sum_t |U^_v,t| a chunk (decays and |Kr| are at most 1, so
// no entry grows by more). Where a row's bound or sum |U^| passes kRescaleHigh, or sum |U^| falls
// under kRescaleLow, the warp rescales all its rows before the update (rescale_rows): S^ then
// stays under 2 kRescaleHigh = 2^15 < 65504 at the next conversion and U^ in fp16's normal range.
// tools/numerics/state_pass_precision.py (fp16-scaled) models exactly this.
#pragma once

#include "gpu/prefill/state_step.cuh"

namespace flashkda::gpu::state_pass {

constexpr float kRescaleHigh = 16384.0f;   // 2^14
constexpr float kRescaleLow = 0.015625f;   // 2^-6
constexpr int kRescaleTo = 2;              // a rescaled row's max in [2^2, 2^3)

// A lane's rows g and g + 8 (index r): S = S^ up[r], and the bound on |S^| of the row.
struct RowScale {
  float up[2], down[2], bound[2];
};

// 2^(kRescaleTo - floor(log2 m)) for m > 0 (1 for m = 0 or NaN; Inf gives 2^-126, kept Inf).
__device__ __forceinline__ float rescale_factor(float m) {
  if (!(m > 0.0f)) return 1.0f;
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xff) - 127;  // fp32 subnormals: -127
  const int f = max(-126, min(127, kRescaleTo - e));
  return __uint_as_float(static_cast<uint32_t>(f + 127) << 23);
}

// Sum (or max) over the four lanes of a quad: the lanes holding one state row.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Row r's max |x| over this lane's elements of C-ordered state registers (elements 2r, 2r + 1).
template <int kTiles>
__device__ __forceinline__ float row_abs_max(const float (&x)[kTiles][4], int r) {
  float m = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) m = fmaxf(m, fmaxf(fabsf(x[nt][2 * r]), fabsf(x[nt][2 * r + 1])));
  return m;
}

// Puts each of the warp's rows at its scale: max(|S^|, |U^|) in [2^kRescaleTo, 2^(kRescaleTo+1)),
// the bound exact again. The rare branch (0-16 times in 4096 warp steps in the model).
__device__ __forceinline__ void rescale_rows(float (&acc)[kNTiles][4], float (&u)[2][4], RowScale& sc, float (&su)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float ms = quad_max(row_abs_max(acc, r));
    const float f = rescale_factor(fmaxf(ms, quad_max(row_abs_max(u, r))));
#pragma unroll
    for (int nl = 0; nl < kNTiles; ++nl) acc[nl][2 * r] *= f, acc[nl][2 * r + 1] *= f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) u[nt][2 * r] *= f, u[nt][2 * r + 1] *= f;
    sc.up[r] *= 1.0f / f;  // powers of two: exact
    sc.down[r] *= f;
    sc.bound[r] = ms * f;
    su[r] *= f;
  }
}

// After the state's load (true values, C order): every row at its scale.
__device__ __forceinline__ void init_row_scale(float (&acc)[kNTiles][4], RowScale& sc) {
  float u[2][4] = {}, su[2] = {};
  sc.up[0] = sc.up[1] = sc.down[0] = sc.down[1] = 1.0f;
  rescale_rows(acc, u, sc, su);
}

// The true values as a store reads them (store_state's Scale), the registers left as they are: the
// checkpoints, which a later step goes on from (a power of two: the same bits as unscale_rows).
struct RowScaled {
  const RowScale& sc;
  __device__ __forceinline__ float operator()(int r, float x) const { return x * sc.up[r]; }
};

// Before the state's store: the true values back in the registers.
__device__ __forceinline__ void unscale_rows(float (&acc)[kNTiles][4], const RowScale& sc) {
#pragma unroll
  for (int nl = 0; nl < kNTiles; ++nl)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nl][i] *= sc.up[i >> 1];
}

// Byte offsets of this lane's entries in an F16Record (+ 2048 nt + 256 j for Wk and Qe, + 256 nl
// for Kr), and LaneOffsets's W / M and decay offsets for the fields F16Record keeps as they are.
struct F16LaneOffsets {
  uint32_t wk, qe, kr, decay;
  uint32_t m[2];
  __device__ __forceinline__ void init(int lane) {
    LaneOffsets o;
    o.init<kNTiles>(lane, 0);
    wk = F16Record::kWk + 8 * lane;
    qe = F16Record::kQe + 8 * lane;
    kr = F16Record::kKr + 8 * lane;
    decay = o.decay - ChunkRecord::kDecay + F16Record::kDecay;
    m[0] = o.m[0], m[1] = o.m[1];
  }
};

__device__ __forceinline__ uint2 load_entry(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }

// One chunk step of one warp: value rows [vbase, vbase + 16), all key channels, the state S^ in
// C order (state_step.cuh's StateOrder::kC) at the scales of `sc`.
template <typename OutT>
__device__ __forceinline__ void chunk_step_f16(float (&acc)[kNTiles][4], RowScale& sc, const uint8_t* rec,
                                               const F16LaneOffsets& o, int vbase, int lane, OutT* out_chunk,
                                               int count, int64_t out_row_stride) {
  // X^T and P^T over the 8 k-tiles of 16 channels: k-tile j's A fragment is n-tiles 2j, 2j + 1
  // packed (mma.cuh). Two accumulators a product and n-tile, as the tf32 step.
  constexpr int kChains = 2;
  float X[2][kChains][4] = {}, Pc[2][kChains][4] = {};
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j) {
    const uint32_t a[4] = {ptx::pack_f16x2(acc[2 * j][0], acc[2 * j][1]), ptx::pack_f16x2(acc[2 * j][2], acc[2 * j][3]),
                           ptx::pack_f16x2(acc[2 * j + 1][0], acc[2 * j + 1][1]),
                           ptx::pack_f16x2(acc[2 * j + 1][2], acc[2 * j + 1][3])};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint2 w = load_entry(rec + o.wk + 2048 * nt + 256 * j);
      const uint2 e = load_entry(rec + o.qe + 2048 * nt + 256 * j);
      ptx::mma_f16_16816(X[nt][j % kChains], a, w.x, w.y);
      ptx::mma_f16_16816(Pc[nt][j % kChains], a, e.x, e.y);
    }
  }
  float wv[2][4];
  form_wv<F16Record>(rec, o.m, vbase, lane, count, wv);
  // P to the true scale, U^ in the rows' scale, and each row's sum |U^| (its bound's growth).
  float P[2][4], u[2][4], su[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1;
      P[nt][i] = (Pc[nt][0][i] + Pc[nt][1][i]) * sc.up[r];
      u[nt][i] = fmaf(wv[nt][i], sc.down[r], -(X[nt][0][i] + X[nt][1][i]));
      su[r] += fabsf(u[nt][i]);
    }
  // The tests with `|` and `&`, not `||` and `&&`: short-circuit evaluation compiled to a branch
  // and a reconvergence point a test, on the chain between U^ and the update (ncu stall sampling
  // at P1 and P4: 14% and 17% of the step loop's samples from the sums of |U^| to the vote).
  bool outside = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    su[r] = quad_sum(su[r]);
    outside |= (sc.bound[r] > kRescaleHigh) | (su[r] > kRescaleHigh) | ((su[r] < kRescaleLow) & (su[r] > 0.0f));
  }
  if (__any_sync(0xffffffffu, outside)) rescale_rows(acc, u, sc, su);
  sc.bound[0] += su[0];
  sc.bound[1] += su[1];

  // S^T = S^T D + U^T Kr: U^T's A fragment (k = the chunk's 16 tokens) is its two C fragments
  // packed; one m16n8k16 an n-tile of 8 channels, into the state's registers after the decay.
  const uint32_t ua[4] = {ptx::pack_f16x2(u[0][0], u[0][1]), ptx::pack_f16x2(u[0][2], u[0][3]),
                          ptx::pack_f16x2(u[1][0], u[1][1]), ptx::pack_f16x2(u[1][2], u[1][3])};
#pragma unroll
  for (int nl = 0; nl < kNTiles; ++nl) {
    const float2 d = load_pair(rec + o.decay + 32 * nl);
    acc[nl][0] *= d.x;
    acc[nl][1] *= d.y;
    acc[nl][2] *= d.x;
    acc[nl][3] *= d.y;
    const uint2 b = load_entry(rec + o.kr + 256 * nl);
    ptx::mma_f16_16816(acc[nl], ua, b.x, b.y);
  }

  finish_out_rows<F16Record>(P, wv, rec, o.m, vbase, lane, out_chunk, count, out_row_stride);
}

}  // namespace flashkda::gpu::state_pass
