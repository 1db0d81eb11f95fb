// The chunk step of the state pass and the pieces around it (state fragments, record offsets,
// stage fills), shared by the per-(sequence, head) kernel (state_kernel.cu) and the persistent
// one for many (sequence, head) items (state_persistent_kernel.cu). See state_kernel.cu for the
// math.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "common/bf16.h"
#include "gpu/common/state_slots.cuh"  // CheckpointTable
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/kernels.h"  // kVRowStride
#include "gpu/prefill/stage_ring.cuh"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/movmatrix.cuh"
#include "gpu/ptx/mma.cuh"

namespace flashkda::gpu::state_pass {

constexpr int kNTiles = kHeadDim / 8;  // 16 n-tiles of 8 key channels

constexpr uint32_t kVRowBytes = kChunk * kVRowStride * 2;  // a chunk's v rows of one head in a stage
static_assert(kVRowBytes % 128 == 0, "stages stay aligned");

// The register order of a state slice. Per n-tile of 8 key channels a lane holds four elements,
// (row g, col 2t), (row g, col 2t + 1), (row g + 8, col 2t), (row g + 8, col 2t + 1) as
//   kC: elements 0, 1, 2, 3, the mma C fragment: the update accumulates into the registers in
//       place (FMUL by the decay, then HMMA), but the products that read S^T need them as A
//       fragments (elements 0, 2, 1, 3), and ptxas copies ~60 registers a chunk step for that
//       (76 IMAD.MOV in the 8x1 step loop at 45a6acf);
//   kA: elements 0, 2, 1, 3, the A fragment of mma.cuh (k-slot t = col 2t, slot t + 4 = col
//       2t + 1): the products read the registers as they stand and the update forms U^T Kr
//       apart, then one FFMA an element (about 12% fewer instructions a step, no copies).
// Which order is faster depends on the layout (H200, docs/perf-notes.md): kA with the 4x1
// layout and the persistent pass (P4 -5%, P10 -7%, P3 -1.5%), kC with the 8x1 and split layouts
// (P1 +2.4%, P7 +0.5% in kA; ncu at P1: 11% fewer instructions, but 5.4 cycles between a warp's
// instructions against 4.4, with new stalls on the shared-memory queue: the 8x1 block's
// shared-memory pipe is its limit, and the copies spaced its loads out).
enum class StateOrder { kC, kA };
// The elements (row g + 8r, col 2t) and (row g + 8r, col 2t + 1) of an n-tile, r = 0, 1.
template <StateOrder O>
__host__ __device__ constexpr int pair_first(int r) { return O == StateOrder::kA ? r : 2 * r; }
template <StateOrder O>
__host__ __device__ constexpr int pair_second(int r) { return O == StateOrder::kA ? r + 2 : 2 * r + 1; }

// Calls fn(nt, r, idx) for each pair of this lane's elements of state rows [row0, row0 + 16),
// columns [col0, col0 + 8 kTiles): acc[nt][pair_first<O>(r)], acc[nt][pair_second<O>(r)] are
// elements idx, idx + 1 of the [.., 128] row-major state.
template <int kTiles, typename Fn>
__device__ __forceinline__ void for_each_state_pair(int64_t row0, int col0, int lane, Fn&& fn) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) fn(nt, r, (row0 + g + 8 * r) * kHeadDim + col0 + nt * 8 + 2 * t4);
}

// The same pairs in a K-major state ([.., 128 k, 128 v] per head; row0 = head row0 + v offset):
// elements idx and idx + 128 (the pair's two key channels are rows of their own).
template <int kTiles, typename Fn>
__device__ __forceinline__ void for_each_state_pair_k_major(int64_t row0, int col0, int lane, Fn&& fn) {
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t head = (row0 / kHeadDim) * kHeadDim * kHeadDim;
  const int v0 = static_cast<int>(row0 % kHeadDim);
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) fn(nt, r, head + int64_t{col0 + nt * 8 + 2 * t4} * kHeadDim + v0 + g + 8 * r);
}

// Loads this lane's part of the state slice (zeros without an initial state).
// kKMajor: the state is stored K-major (two scalar loads a pair; once a sequence).
template <StateOrder O, bool kKMajor = false, int kTiles>
__device__ __forceinline__ void load_state(float (&acc)[kTiles][4], const void* state, bool f32, int64_t row0,
                                           int col0, int lane) {
  if constexpr (kKMajor) {
    for_each_state_pair_k_major<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
      float x = 0.0f, y = 0.0f;
      if (state) {
        if (f32) {
          x = __ldg(static_cast<const float*>(state) + idx);
          y = __ldg(static_cast<const float*>(state) + idx + kHeadDim);
        } else {
          x = bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(state) + idx));
          y = bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(state) + idx + kHeadDim));
        }
      }
      acc[nt][pair_first<O>(r)] = x;
      acc[nt][pair_second<O>(r)] = y;
    });
    return;
  }
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    float2 x = make_float2(0.0f, 0.0f);
    if (state) {
      if (f32) x = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(state) + idx));
      else x = ptx::unpack_bf16x2(__ldg(reinterpret_cast<const unsigned*>(static_cast<const uint16_t*>(state) + idx)));
    }
    acc[nt][pair_first<O>(r)] = x.x;
    acc[nt][pair_second<O>(r)] = x.y;
  });
}

// The identity as the initial state (rows v, columns k): the split passes' A runs (state_kernel.cu,
// state_wgmma_kernel.cu).
template <StateOrder O, int kTiles>
__device__ __forceinline__ void load_identity(float (&acc)[kTiles][4], int64_t row0, int col0, int lane) {
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    const int64_t v = idx / kHeadDim, k = idx % kHeadDim;
    acc[nt][pair_first<O>(r)] = v == k ? 1.0f : 0.0f;
    acc[nt][pair_second<O>(r)] = v == k + 1 ? 1.0f : 0.0f;
  });
}

// What a store multiplies a lane's elements of row half r by: nothing (the tf32 step's states),
// or the fp16 step's row scales (RowScaled, state_step_f16.cuh), so that checkpoints store the
// true state while the registers keep theirs.
struct Unscaled {
  __device__ __forceinline__ float operator()(int, float x) const { return x; }
};

// kPairStores: fp32 pairs as 8-byte stores. The stores inside the chunk loop (the checkpoints)
// take two 4-byte ones: an 8-byte store wants the pair in adjacent registers, against the A
// fragments the products read, and ptxas then copied ~130-170 registers a step in the serving
// kernels' step loops (SASS, 8x1, either order).
template <StateOrder O, bool kKMajor = false, bool kPairStores = true, int kTiles, typename Scale = Unscaled>
__device__ __forceinline__ void store_state(const float (&acc)[kTiles][4], void* state, bool f32, int64_t row0,
                                            int col0, int lane, Scale scale = {}) {
  if constexpr (kKMajor) {
    for_each_state_pair_k_major<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
      const float x = scale(r, acc[nt][pair_first<O>(r)]), y = scale(r, acc[nt][pair_second<O>(r)]);
      if (f32) {
        static_cast<float*>(state)[idx] = x;
        static_cast<float*>(state)[idx + kHeadDim] = y;
      } else {
        static_cast<uint16_t*>(state)[idx] = float_to_bf16(x);
        static_cast<uint16_t*>(state)[idx + kHeadDim] = float_to_bf16(y);
      }
    });
    return;
  }
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    const float x = scale(r, acc[nt][pair_first<O>(r)]), y = scale(r, acc[nt][pair_second<O>(r)]);
    if (f32 && kPairStores) *reinterpret_cast<float2*>(static_cast<float*>(state) + idx) = make_float2(x, y);
    else if (f32) static_cast<float*>(state)[idx] = x, static_cast<float*>(state)[idx + 1] = y;
    else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(state) + idx) = ptx::pack_bf16x2(x, y);
  });
}

// This lane's part of the state after `tokens` tokens of sequence n into every checkpoint entry
// asking for it (fp32 [N, C, H, 128, 128], in the states' layout).
template <StateOrder O, bool kKMajor = false, int kTiles, typename Scale = Unscaled>
__device__ __forceinline__ void write_checkpoints(const CheckpointTable& t, const float (&acc)[kTiles][4], int64_t n,
                                                  int h, int num_heads, int64_t tokens, int vbase, int col0, int lane,
                                                  Scale scale = {}) {
  t.at(n, tokens, [&](int64_t entry) {
    store_state<O, kKMajor, false>(acc, t.states, true, (entry * num_heads + h) * int64_t{kHeadDim} + vbase, col0, lane,
                                   scale);
  });
}

// Named barrier over the `threads` threads of one value slice (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void slice_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Exchange area of one value slice: each of the KS warps posts its partial X^T and O^T
// fragments (16 floats a lane) as four float4 stored [vector][lane], conflict-free both ways.
template <int KS>
struct SliceExchange {
  float4 part[KS][4][32];
};

// Byte offsets of this lane's fragment reads inside a chunk record, fixed for the whole
// sequence: every read is one of these registers plus a compile-time immediate.
struct LaneOffsets {
  uint32_t wk;     // Wk entry of this warp's first channel tile, token half 0; + 4096 nt + 256 nl
  uint32_t qe;     // Qe entry, same fragment;                                  + 2048 nt + 128 nl
  uint32_t kr;     // Kr entry of this warp's first channel tile, token half 0; + 512 nl + 256 kt
  uint32_t m[2];   // M and W: row g, token k-tile kt;                          + 512 nt
  uint32_t decay;  // exp(G_C): channel 8 tile0 + 2 t4;                         + 32 nl

  template <int kTiles>
  __device__ __forceinline__ void init(int lane, int kpart) {
    const int g = lane >> 2, t4 = lane & 3, g1 = (g >> 1) & 1;
    const int tile0 = kpart * kTiles;  // first channel tile of this warp
    wk = ChunkRecord::kWk + fragment_entry(tile0, lane, 8);
    qe = ChunkRecord::kQe + fragment_entry(tile0, lane, 4);
    kr = ChunkRecord::kKr + fragment_entry(2 * tile0, lane, 8);
#pragma unroll
    for (int k = 0; k < 2; ++k) m[k] = 4 * (16 * g + 8 * (k ^ g1) + 2 * t4);
    decay = ChunkRecord::kDecay + 4 * (8 * tile0 + 2 * t4);
  }
};

// Two adjacent fp32 elements of a record tile (8-byte aligned by construction).
__device__ __forceinline__ float2 load_pair(const uint8_t* p) { return *reinterpret_cast<const float2*>(p); }

// Two adjacent bf16 elements of a record tile, widened to fp32 (exact in tf32).
__device__ __forceinline__ float2 load_bf16_pair(const uint8_t* p) {
  return ptx::unpack_bf16x2(*reinterpret_cast<const uint32_t*>(p));
}

// Token row `tok`'s bf16 v at column v as a tf32 operand (exact), 0 where !live. Loaded whatever
// `live` and then selected: the stage always holds 16 rows (zeros past the problem's end, the next
// sequence's tokens past a sequence's end). A load under `live` became a branch a load, its
// address formed again inside: 22% of the 8x1 pass's stall samples at P1 (ncu, a90b8b6), where
// the probe that steps full chunks has none.
__device__ __forceinline__ uint32_t v_operand(const uint16_t* v_rows, int tok, int v, bool live) {
  const uint32_t bits = v_rows[tok * kVRowStride + v];
  return live ? bits << 16 : 0u;
}

// (W V)^T = V^T W^T as C fragments (rows v = vbase + g (+ 8), columns tokens): A = V^T from the
// chunk's v rows after the record (bf16, exact in tf32; rows past the sequence end read as 0),
// B = W^T with W split hi + lo (the mma truncates lo to tf32: W V keeps ~21 bits). m_offsets:
// LaneOffsets::m. Record: where the stage's W and v rows lie.
template <typename Record>
__device__ __forceinline__ void form_wv(const uint8_t* rec, const uint32_t (&m_offsets)[2], int vbase, int lane,
                                        int count, float (&wv)[2][4]) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) wv[nt][i] = 0.0f;
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(rec + Record::kBytes);  // [16][kVRowStride]
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    const int tok = kt * 8 + 2 * t4;
    uint32_t a[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool live = tok + e < count;
      a[2 * e] = v_operand(v_rows, tok + e, vbase + g, live);          // a[0] (row g, slot t), a[2] (row g, slot t + 4)
      a[2 * e + 1] = v_operand(v_rows, tok + e, vbase + g + 8, live);  // a[1] (row g + 8, slot t), a[3] (row g + 8, slot t + 4)
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 w = load_pair(rec + Record::kW + m_offsets[kt] + 512 * nt);
      const float hi_x = ptx::tf32_high_part(w.x), hi_y = ptx::tf32_high_part(w.y);
      ptx::mma_tf32_1688(wv[nt], a, hi_x, hi_y);
      ptx::mma_tf32_1688(wv[nt], a, w.x - hi_x, w.y - hi_y);
    }
  }
}

// A warp's O^T fragments (rows v = vbase .. + 15, columns tokens 8 nt ..: C fragments) into the
// chunk's out rows from out_chunk, the first `count` tokens: bf16 transposed in registers to
// (token, v pair) stores, or (OutT float, the split pass's partial rows) fp32 straight from the
// fragments. Shared by the mma.sync step below and the wgmma step (state_wgmma_step.cuh).
template <int kNBlocks, typename OutT>
__device__ __forceinline__ void store_out_rows(const float (&o)[kNBlocks][4], int vbase, int lane, OutT* out_chunk,
                                               int count, int64_t out_row_stride) {
  const int g = lane >> 2, t4 = lane & 3;
  if constexpr (std::is_same_v<OutT, float>) {
#pragma unroll
    for (int nt = 0; nt < kNBlocks; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = nt * 8 + 2 * t4 + (i & 1), v = vbase + g + 8 * (i >> 1);
        if (token < count) out_chunk[token * out_row_stride + v] = o[nt][i];
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNBlocks; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t ov = ptx::movmatrix_trans(ptx::pack_bf16x2(o[nt][2 * r], o[nt][2 * r + 1]));
        const int token = nt * 8 + g;
        if (token < count)
          *reinterpret_cast<uint32_t*>(out_chunk + token * out_row_stride + vbase + 8 * r + 2 * t4) = ov;
      }
  }
}

// O^T += (W V)^T M^T (the intra-chunk part, tf32; M at Record::kM, m_offsets: LaneOffsets::m),
// then the out rows: the end of both mma.sync step forms (chunk_step, chunk_step_f16).
template <typename Record, typename OutT>
__device__ __forceinline__ void finish_out_rows(float (&P)[2][4], const float (&wv)[2][4], const uint8_t* rec,
                                                const uint32_t (&m_offsets)[2], int vbase, int lane, OutT* out_chunk,
                                                int count, int64_t out_row_stride) {
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    uint32_t a[4];
    ptx::tf32_a_from_c(wv[kt], a);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 mm = load_pair(rec + Record::kM + m_offsets[kt] + 512 * nt);
      ptx::mma_tf32_1688(P[nt], a, mm.x, mm.y);
    }
  }
  store_out_rows(P, vbase, lane, out_chunk, count, out_row_stride);
}

// One chunk step of one warp: value columns [vbase, vbase + 16), key n-tiles [kpart * kTiles,
// (kpart + 1) * kTiles) of the state slice (kTiles = 16 / KS). All products are m16n8k8 tf32 with
// k-slot t = element 2t and slot t + 4 = element 2t + 1 (see mma.cuh): every C fragment is an A
// fragment with elements 1 and 2 swapped, and every B fragment one shared-memory load (8 bytes
// of fp32 or 4 of bf16, conflict-free in the record's fragment order).
// OutT: uint16_t (bf16 out) or float (the split pass's fp32 partial outputs). O: the order the
// state's registers are kept in (StateOrder).
template <StateOrder O, int KS, typename OutT>
__device__ __forceinline__ void chunk_step(float (&acc)[kNTiles / KS][4], const uint8_t* rec, const LaneOffsets& o,
                                           int vbase, int kpart, int lane, SliceExchange<KS>* exchange,
                                           int barrier_id, OutT* out_chunk, int count, int64_t out_row_stride) {
  constexpr int kTiles = kNTiles / KS;

  // Partial X^T = S^T Wk^T and P = S^T Qe^T over this warp's key channels. A k-tile is one
  // n-tile (8 channels) of S^T. Two accumulators per product and n-tile (four independent mma
  // chains per product, enough beside the other warps of the scheduler; four accumulators
  // measured 8% slower on P1: more registers and adds for no more overlap).
  constexpr int kChains = 2;
  static_assert(kTiles % kChains == 0, "whole chains");
  float X[2][kChains][4] = {};
  float Pc[2][kChains][4] = {};
#pragma unroll
  for (int nl = 0; nl < kTiles; ++nl) {
    uint32_t a[4];
    if constexpr (O == StateOrder::kA) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = __float_as_uint(acc[nl][i]);
    } else {
      ptx::tf32_a_from_c(acc[nl], a);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 w = load_pair(rec + o.wk + 4096 * nt + 256 * nl);
      const float2 e = load_bf16_pair(rec + o.qe + 2048 * nt + 128 * nl);
      ptx::mma_tf32_1688(X[nt][nl % kChains], a, w.x, w.y);
      ptx::mma_tf32_1688(Pc[nt][nl % kChains], a, e.x, e.y);
    }
  }
  float Xs[2][4], P[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Xs[nt][i] = X[nt][0][i];
      P[nt][i] = Pc[nt][0][i];
#pragma unroll
      for (int ch = 1; ch < kChains; ++ch) {
        Xs[nt][i] += X[nt][ch][i];
        P[nt][i] += Pc[nt][ch][i];
      }
    }

  if constexpr (KS > 1) {  // sum the partial products of the slice's KS warps (own one included)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      exchange->part[kpart][nt][lane] = make_float4(Xs[nt][0], Xs[nt][1], Xs[nt][2], Xs[nt][3]);
      exchange->part[kpart][2 + nt][lane] = make_float4(P[nt][0], P[nt][1], P[nt][2], P[nt][3]);
    }
    slice_barrier(barrier_id, KS * 32);
    const int parts = kpart == 0 ? 4 : 2;  // only part 0 stores the output and needs all of P
#pragma unroll
    for (int v4 = 0; v4 < 4; ++v4) {
      if (v4 >= parts) break;
      float4 sum = exchange->part[0][v4][lane];
#pragma unroll
      for (int other = 1; other < KS; ++other) {
        const float4 x = exchange->part[other][v4][lane];
        sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
      }
      float(&dst)[4] = v4 < 2 ? Xs[v4] : P[v4 - 2];
      dst[0] = sum.x, dst[1] = sum.y, dst[2] = sum.z, dst[3] = sum.w;
    }
  }

  // (W V)^T, then U^T = (W V)^T - X^T, rounded to tf32 as the A fragments (k = tokens) of the
  // state update.
  float wv[2][4];
  form_wv<ChunkRecord>(rec, o.m, vbase, lane, count, wv);
  uint32_t ua[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = ptx::tf32_operand(wv[nt][i] - Xs[nt][i]);
    ptx::tf32_a_from_c(u, ua[nt]);
  }

  // S^T = S^T Diag(exp(G_C)) + U^T Kr on this warp's key channels. kC: the decay in place, then
  // the products accumulate into the state's registers; kA: U^T Kr into a C fragment of its own,
  // then one FFMA an element (the state's elements 1 and 2 are C's 2 and 1).
#pragma unroll
  for (int nl = 0; nl < kTiles; ++nl) {
    const float2 d = load_pair(rec + o.decay + 32 * nl);
    if constexpr (O == StateOrder::kC) {
      acc[nl][0] *= d.x;
      acc[nl][1] *= d.y;
      acc[nl][2] *= d.x;
      acc[nl][3] *= d.y;
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const float2 b = load_pair(rec + o.kr + 512 * nl + 256 * kt);
        ptx::mma_tf32_1688(acc[nl], ua[kt], b.x, b.y);
      }
    } else {
      float upd[4] = {};
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const float2 b = load_pair(rec + o.kr + 512 * nl + 256 * kt);
        ptx::mma_tf32_1688(upd, ua[kt], b.x, b.y);
      }
      acc[nl][0] = fmaf(acc[nl][0], d.x, upd[0]);  // row g,     col 2t
      acc[nl][1] = fmaf(acc[nl][1], d.x, upd[2]);  // row g + 8, col 2t
      acc[nl][2] = fmaf(acc[nl][2], d.y, upd[1]);  // row g,     col 2t + 1
      acc[nl][3] = fmaf(acc[nl][3], d.y, upd[3]);  // row g + 8, col 2t + 1
    }
  }

  if (kpart != 0) return;
  finish_out_rows<ChunkRecord>(P, wv, rec, o.m, vbase, lane, out_chunk, count, out_row_stride);
}

// One pipeline stage: the chunk record, then the chunk's 16 rows of v (bf16, kVRowStride apart).
constexpr uint32_t kStageBytes = ChunkRecord::kBytes + kVRowBytes;
// Dynamic shared memory one block may take on the multiprocessors these kernels run on (sm_90),
// and what a multiprocessor holds for all its blocks (each block also costs 1 KB reserved).
constexpr int kMaxBlockSmem = 227 * 1024;
constexpr int kSmemPerSm = 228 * 1024;

// Stages of a pipeline that fit `blocks` blocks a multiprocessor beside `extra` bytes a block
// (128 bytes of barriers included), at most 6: more measured no faster (perf-notes, b459807).
constexpr int stages_fitting(int blocks, int extra) {
  const int per_block = kSmemPerSm / blocks - 1024 < kMaxBlockSmem ? kSmemPerSm / blocks - 1024 : kMaxBlockSmem;
  const int stages = (per_block - 128 - extra) / static_cast<int>(kStageBytes);
  return stages < 6 ? stages : 6;
}

// Fills a stage (one producer thread): the chunk record (ChunkRecord, or the wgmma pass's
// WgmmaRecord), and the chunk's 16 v rows of head h as one tensor-map tile after it (rows past
// the problem's end arrive as zeros).
template <typename Record = ChunkRecord>
__device__ __forceinline__ void fill_stage(uint8_t* stage, uint64_t* full, const uint8_t* record,
                                           const CUtensorMap* v_rows, int h, int64_t token0) {
  ptx::mbarrier_arrive_expect_tx(full, Record::kBytes + kVRowBytes);
  ptx::bulk_copy_g2s(stage, record, Record::kBytes, full);
  ptx::tensor_copy_3d_g2s(stage + Record::kBytes, v_rows, 0, h, static_cast<int>(token0), full);
}

}  // namespace flashkda::gpu::state_pass
