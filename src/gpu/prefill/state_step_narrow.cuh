// The chunk step of the narrow layout (state_narrow_kernel.cu): one warp owns 8 value columns of
// one head and all 128 key channels, the state S^ [128 k][8 v] itself (not S^T) as eight m16n8 C
// fragments, m-tile mt holding channels 16 mt .. + 15. A head then takes 16 warps, twice the
// 16-column slices of state_step_f16.cuh, each with half the work a step: for few (sequence,
// head) items, where the 4x1 layout leaves one warp a scheduler and the step's latency exposed.
//
// Same record (F16Record) and the same products as the fp16 step, with tokens on the rows:
//   X^ = Wk S^,  P^ = Qe S^    m16n8k16 fp16; A = Wk, Qe [16 t][16 k]: the record's B fragments
//                              of token n-tiles 0 and 1 paired; B = fp16(S^) by movmatrix
//   W V                        m16n8k8 tf32, A = W split hi + lo, B = V from the stage's rows
//   U^ = W V 2^-e_v - X^,  O = P^ 2^e_v + M (W V)
//                              tf32; B = W V transposed exactly (movmatrix on its 16-bit halves)
//   S^ = D S^ + Kr^T fp16(U^)  m16n8k16; A = Kr^T [16 k][16 t]: the record's Kr n-tiles 2 mt and
//                              2 mt + 1 paired; B = fp16(U^) by movmatrix
// Column v carries the power of two e_v of state_step_f16.cuh's rows (RowScale, index e: column
// vbase + 2 t4 + e), with the same bound, tests and rescale.
#pragma once

#include "gpu/prefill/state_step_f16.cuh"

namespace flashkda::gpu::state_pass {

constexpr int kNarrowWidth = 8;                // value columns a warp
constexpr int kNarrowTiles = kHeadDim / 16;    // m-tiles of 16 key channels
using NarrowState = float[kNarrowTiles][4];    // element i of m-tile mt: channel 16 mt + g + 8 (i >> 1),
                                               // column vbase + 2 t4 + (i & 1)

// fn(mt, i, idx) for each of this lane's elements; idx: the element's index in the V-major state
// ([.., 128 v, 128 k]) whose row row0 is column vbase.
template <typename Fn>
__device__ __forceinline__ void for_each_narrow_element(int64_t row0, int lane, Fn&& fn) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kNarrowTiles; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) fn(mt, i, (row0 + 2 * t4 + (i & 1)) * kHeadDim + 16 * mt + g + 8 * (i >> 1));
}

// This lane's elements of the state (zeros without one), fp32 or bf16. Scalar loads, once a
// sequence: 8 lanes read 32 contiguous bytes.
__device__ __forceinline__ void load_narrow_state(NarrowState& acc, const void* state, bool f32, int64_t row0, int lane) {
  for_each_narrow_element(row0, lane, [&](int mt, int i, int64_t idx) {
    float x = 0.0f;
    if (state) {
      if (f32) x = __ldg(static_cast<const float*>(state) + idx);
      else x = bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(state) + idx));
    }
    acc[mt][i] = x;
  });
}

__device__ __forceinline__ void store_narrow_state(const NarrowState& acc, void* state, bool f32, int64_t row0, int lane) {
  for_each_narrow_element(row0, lane, [&](int mt, int i, int64_t idx) {
    if (f32) static_cast<float*>(state)[idx] = acc[mt][i];
    else static_cast<uint16_t*>(state)[idx] = float_to_bf16(acc[mt][i]);
  });
}

// Over the 8 lanes holding one column (same t4): the key channels of the column.
__device__ __forceinline__ float column_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}
__device__ __forceinline__ float column_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

// rescale_rows for columns: max(|S^|, |U^|) of each of the lane's columns e into
// [2^kRescaleTo, 2^(kRescaleTo + 1)), the bound exact again. u: U^'s C fragment (rows tokens).
__device__ __forceinline__ void rescale_columns(NarrowState& acc, float (&u)[4], RowScale& sc, float (&su)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float m = 0.0f;
#pragma unroll
    for (int mt = 0; mt < kNarrowTiles; ++mt) m = fmaxf(m, fmaxf(fabsf(acc[mt][e]), fabsf(acc[mt][e + 2])));
    const float ms = column_max(m);
    const float f = rescale_factor(fmaxf(ms, column_max(fmaxf(fabsf(u[e]), fabsf(u[e + 2])))));
#pragma unroll
    for (int mt = 0; mt < kNarrowTiles; ++mt) acc[mt][e] *= f, acc[mt][e + 2] *= f;
    u[e] *= f;
    u[e + 2] *= f;
    sc.up[e] *= 1.0f / f;  // powers of two: exact
    sc.down[e] *= f;
    sc.bound[e] = ms * f;
    su[e] *= f;
  }
}

__device__ __forceinline__ void init_column_scale(NarrowState& acc, RowScale& sc) {
  float u[4] = {}, su[2] = {};
  sc.up[0] = sc.up[1] = sc.down[0] = sc.down[1] = 1.0f;
  rescale_columns(acc, u, sc, su);
}

__device__ __forceinline__ void unscale_columns(NarrowState& acc, const RowScale& sc) {
#pragma unroll
  for (int mt = 0; mt < kNarrowTiles; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] *= sc.up[i & 1];
}

// Byte offsets of this lane's reads in an F16Record: Wk / Qe entries (+ 2048 token n-tile
// + 256 k-tile), Kr entries (+ 256 channel n-tile), exp(G_C) of channel g (+ 64 mt, + 32 for
// g + 8), and LaneOffsets::m for W and M (row g's pair; + 512: row g + 8).
struct NarrowLaneOffsets {
  uint32_t wk, qe, kr, decay;
  uint32_t m[2];
  __device__ __forceinline__ void init(int lane) {
    LaneOffsets o;
    o.init<kNTiles>(lane, 0);
    wk = F16Record::kWk + 8 * lane;
    qe = F16Record::kQe + 8 * lane;
    kr = F16Record::kKr + 8 * lane;
    decay = F16Record::kDecay + 4 * (lane >> 2);
    m[0] = o.m[0], m[1] = o.m[1];
  }
};

// The A fragment of an m16n8k16 product from two B-fragment entries of the record: rows g
// (entry `top`) and g + 8 (entry `bottom`), k 2 t4 .. (low words) and 2 t4 + 8 .. (high words).
__device__ __forceinline__ void a_from_entries(uint2 top, uint2 bottom, uint32_t (&a)[4]) {
  a[0] = top.x, a[1] = bottom.x, a[2] = top.y, a[3] = bottom.y;
}

// A tf32 A fragment of a [16][16] fp32 record tile (W, M; k-tile kt): rows g and g + 8.
__device__ __forceinline__ void tf32_a_from_tile(const uint8_t* tile, uint32_t m_offset, float (&x)[4]) {
  const float2 top = load_pair(tile + m_offset), bottom = load_pair(tile + m_offset + 512);
  x[0] = top.x, x[1] = bottom.x, x[2] = top.y, x[3] = bottom.y;
}

// B fragments of an m16n8k8 tf32 product (k = the C fragment's rows 8 kt .., the A fragments'
// k order: slot t4 = row 2 t4, slot t4 + 4 = row 2 t4 + 1) from C fragment rows 8 kt + g: the
// fp32 8 x 8 block transposed exactly, its high and low halves by one movmatrix each.
__device__ __forceinline__ void tf32_b_from_c(float c0, float c1, float& b0, float& b1) {
  const uint32_t x = __float_as_uint(c0), y = __float_as_uint(c1);
  const uint32_t hi = ptx::movmatrix_trans(__byte_perm(x, y, 0x7632));
  const uint32_t lo = ptx::movmatrix_trans(__byte_perm(x, y, 0x5410));
  b0 = __uint_as_float(__byte_perm(lo, hi, 0x5410));
  b1 = __uint_as_float(__byte_perm(lo, hi, 0x7632));
}

// One chunk step of one warp: columns [vbase, vbase + 8), the state S^ at the scales of `sc`,
// the chunk's `count` out rows from out_chunk (bf16 pairs).
__device__ __forceinline__ void chunk_step_narrow(NarrowState& acc, RowScale& sc, const uint8_t* rec,
                                                  const NarrowLaneOffsets& o, int vbase, int lane, uint16_t* out_chunk,
                                                  int count, int64_t out_row_stride) {
  const int g = lane >> 2, t4 = lane & 3;
  // X^ and P^ over the 8 k-tiles of 16 channels (m-tile j of S^), two accumulators each.
  constexpr int kChains = 2;
  float X[kChains][4] = {}, Pc[kChains][4] = {};
#pragma unroll
  for (int j = 0; j < kNarrowTiles; ++j) {
    const uint32_t b0 = ptx::movmatrix_trans(ptx::pack_f16x2(acc[j][0], acc[j][1]));
    const uint32_t b1 = ptx::movmatrix_trans(ptx::pack_f16x2(acc[j][2], acc[j][3]));
    uint32_t a[4];
    a_from_entries(load_entry(rec + o.wk + 256 * j), load_entry(rec + o.wk + 2048 + 256 * j), a);
    ptx::mma_f16_16816(X[j % kChains], a, b0, b1);
    a_from_entries(load_entry(rec + o.qe + 256 * j), load_entry(rec + o.qe + 2048 + 256 * j), a);
    ptx::mma_f16_16816(Pc[j % kChains], a, b0, b1);
  }
  // W V: V's B fragments are single elements of the stage's v rows (token 8 kt + 2 t4 (+ 1),
  // column vbase + g), zero past the chunk's count.
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(rec + F16Record::kBytes);  // [16][kVRowStride]
  float vb[2][2], wv[4] = {};
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    const int tok = kt * 8 + 2 * t4;
    vb[kt][0] = __uint_as_float(v_operand(v_rows, tok, vbase + g, tok < count));
    vb[kt][1] = __uint_as_float(v_operand(v_rows, tok + 1, vbase + g, tok + 1 < count));
    float w[4];
    tf32_a_from_tile(rec + F16Record::kW, o.m[kt], w);
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float h = ptx::tf32_high_part(w[i]);
      hi[i] = __float_as_uint(h);
      lo[i] = __float_as_uint(w[i] - h);
    }
    ptx::mma_tf32_1688(wv, hi, vb[kt][0], vb[kt][1]);
    ptx::mma_tf32_1688(wv, lo, vb[kt][0], vb[kt][1]);
  }
  // P to the true scale, U^ in the columns' scale, each column's sum |U^| (its bound's growth).
  float P[4], u[4], su[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = i & 1;
    P[i] = (Pc[0][i] + Pc[1][i]) * sc.up[e];
    u[i] = fmaf(wv[i], sc.down[e], -(X[0][i] + X[1][i]));
    su[e] += fabsf(u[i]);
  }
  bool outside = false;  // `|` and `&`: no branches (state_step_f16.cuh)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    su[e] = column_sum(su[e]);
    outside |= (sc.bound[e] > kRescaleHigh) | (su[e] > kRescaleHigh) | ((su[e] < kRescaleLow) & (su[e] > 0.0f));
  }
  if (__any_sync(0xffffffffu, outside)) rescale_columns(acc, u, sc, su);
  sc.bound[0] += su[0];
  sc.bound[1] += su[1];

  // S^ = D S^ + Kr^T fp16(U^): one m16n8k16 an m-tile, into the state after its decay.
  const uint32_t ub0 = ptx::movmatrix_trans(ptx::pack_f16x2(u[0], u[1]));
  const uint32_t ub1 = ptx::movmatrix_trans(ptx::pack_f16x2(u[2], u[3]));
#pragma unroll
  for (int mt = 0; mt < kNarrowTiles; ++mt) {
    const float d_top = *reinterpret_cast<const float*>(rec + o.decay + 64 * mt);
    const float d_bottom = *reinterpret_cast<const float*>(rec + o.decay + 64 * mt + 32);
    acc[mt][0] *= d_top;
    acc[mt][1] *= d_top;
    acc[mt][2] *= d_bottom;
    acc[mt][3] *= d_bottom;
    uint32_t a[4];
    a_from_entries(load_entry(rec + o.kr + 256 * (2 * mt)), load_entry(rec + o.kr + 256 * (2 * mt + 1)), a);
    ptx::mma_f16_16816(acc[mt], a, ub0, ub1);
  }

  // O = P + M (W V), tf32 (M as the record keeps it, rounded), then the out rows: tokens g, g + 8.
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    float b0, b1, m[4];
    tf32_b_from_c(wv[2 * kt], wv[2 * kt + 1], b0, b1);
    tf32_a_from_tile(rec + F16Record::kM, o.m[kt], m);
    const uint32_t a[4] = {__float_as_uint(m[0]), __float_as_uint(m[1]), __float_as_uint(m[2]), __float_as_uint(m[3])};
    ptx::mma_tf32_1688(P, a, b0, b1);
  }
  uint16_t* row = out_chunk + vbase + 2 * t4;
  if (g < count) *reinterpret_cast<uint32_t*>(row + g * out_row_stride) = ptx::pack_bf16x2(P[0], P[1]);
  if (g + 8 < count) *reinterpret_cast<uint32_t*>(row + (g + 8) * out_row_stride) = ptx::pack_bf16x2(P[2], P[3]);
}

}  // namespace flashkda::gpu::state_pass
