// The per-token step of the recurrent kernel (recurrent_kernel.cu) on a lane's tile of the state
// in registers, and the loads and stores around it.
//
// Lane layout: 8 lanes share 4 value rows; each holds a 4 x 16 tile of them, 4 value rows by 16
// key columns, so every dot product over the key axis is 16 FMAs and three shuffles. Rows of the
// state are independent given the token's q, k, gate and beta, which each warp prepares for
// itself (TokenPrep: a lane 4 of the 128 columns, in shared memory; no block barrier at all).
// The tile's 16 four-element runs are contiguous in memory in both state layouts (V-major: along
// a row; K-major: along a column), so loads and stores are 16- or 8-byte vectors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gpu/decode/recurrent_params.h"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/fast_math.cuh"

namespace flashkda::gpu::recurrent {

constexpr int kDim = 128;                   // K = V = 128
constexpr int kStateElems = kDim * kDim;    // one head's state
constexpr int kLanesPerRow = 8;             // lanes sharing a row, 16 key columns each
constexpr int kRowsPerLane = 4;
constexpr int kRuns = 16;                   // four-element runs of a lane's tile
constexpr int kRowsPerWarp = 32 / kLanesPerRow * kRowsPerLane;
static_assert(kLanesPerRow * 16 == kDim, "the lanes of a row cover every key column");
static_assert(kRuns * 4 == kRowsPerLane * 16, "a lane's runs cover its tile");

// A lane's state tile: s[j][i][e] = S[v0 + j][kl * 4 + 32 i + e] (value row, key column).
using Tile = float[kRowsPerLane][4][4];

// A lane's place: its value rows v0 .. v0 + 3 within the head and its key-column group kl.
struct LanePlace {
  int lane, kl, v0;
};
// Lane `lane` of the warp taking value rows row0 .. row0 + kRowsPerWarp - 1.
__device__ __forceinline__ LanePlace lane_place(int lane, int row0) {
  return {lane, lane % kLanesPerRow, row0 + (lane / kLanesPerRow) * kRowsPerLane};
}

// Where the lane's 16 contiguous runs of four elements are, and which tile elements they hold.
template <StateLayout L>
struct Runs {
  __device__ __forceinline__ static int offset(int run, int v0, int kl) {
    if constexpr (L == StateLayout::kVK) return (v0 + run / 4) * kDim + kl * 4 + 32 * (run % 4);
    else return (kl * 4 + 32 * (run / 4) + run % 4) * kDim + v0;
  }
  __device__ __forceinline__ static float& at(Tile& s, int run, int c) {
    if constexpr (L == StateLayout::kVK) return s[run / 4][run % 4][c];
    else return s[c][run / 4][run % 4];
  }
};

__device__ __forceinline__ void zero_tile(Tile& s) {
#pragma unroll
  for (int j = 0; j < kRowsPerLane; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][i][e] = 0.f;
}

// Run r's four elements (a bf16 run: its two packed pairs) into the tile; a bf16 run widened.
template <StateLayout L>
__device__ __forceinline__ void set_run(Tile& s, int r, float4 x) {
  Runs<L>::at(s, r, 0) = x.x;
  Runs<L>::at(s, r, 1) = x.y;
  Runs<L>::at(s, r, 2) = x.z;
  Runs<L>::at(s, r, 3) = x.w;
}
template <StateLayout L>
__device__ __forceinline__ void set_run(Tile& s, int r, uint2 packed) {
  const float2 a = ptx::unpack_bf16x2(packed.x), b = ptx::unpack_bf16x2(packed.y);
  set_run<L>(s, r, make_float4(a.x, a.y, b.x, b.y));
}

// Where the lane's run r of a head's state (elements E: float or bf16 bits) starts: run 0's
// address plus a constant, so that the unrolled runs take immediate offsets, no address math.
template <StateLayout L, typename E>
__device__ __forceinline__ E* run_ptr(E* head, int v0, int kl, int r) {
  return head + Runs<L>::offset(0, v0, kl) + Runs<L>::offset(r, 0, 0);
}

// Stores the tile in the state's dtype; the dtype branch is outside the unrolled runs.
template <StateLayout L>
__device__ __forceinline__ void store_tile(Tile& s, void* head_state, bool bf16, int v0, int kl) {
  if (bf16) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
      __stcs(reinterpret_cast<uint2*>(run_ptr<L>(static_cast<uint16_t*>(head_state), v0, kl, r)),
             make_uint2(ptx::pack_bf16x2(Runs<L>::at(s, r, 0), Runs<L>::at(s, r, 1)),
                        ptx::pack_bf16x2(Runs<L>::at(s, r, 2), Runs<L>::at(s, r, 3))));
  } else {
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
      __stcs(reinterpret_cast<float4*>(run_ptr<L>(static_cast<float*>(head_state), v0, kl, r)),
             make_float4(Runs<L>::at(s, r, 0), Runs<L>::at(s, r, 1), Runs<L>::at(s, r, 2), Runs<L>::at(s, r, 3)));
  }
}

// Head h of slot `slot` in a [slots, H, 128, 128] state tensor of the given dtype.
__device__ __forceinline__ void* head_state(void* states, bool bf16, int64_t slot, int num_heads, int h) {
  return static_cast<char*>(states) + (slot * num_heads + h) * int64_t{kStateElems} * (bf16 ? 2 : 4);
}
__device__ __forceinline__ const void* head_state(const void* states, bool bf16, int64_t slot, int num_heads, int h) {
  return head_state(const_cast<void*>(states), bf16, slot, num_heads, h);
}

// Four consecutive bf16 values; one 8-byte load when the rows are aligned for it (a template
// parameter of the kernel: as a runtime flag, the element loads were predicated into every
// token's instructions).
template <bool kVector>
__device__ __forceinline__ uint2 load4(const uint16_t* x) {
  if constexpr (kVector) return *reinterpret_cast<const uint2*>(x);
  else return make_uint2(uint32_t(x[0]) | uint32_t(x[1]) << 16, uint32_t(x[2]) | uint32_t(x[3]) << 16);
}

__device__ __forceinline__ void unpack4(uint2 raw, float* dst) {
  const float2 a = ptx::unpack_bf16x2(raw.x), b = ptx::unpack_bf16x2(raw.y);
  dst[0] = a.x;
  dst[1] = a.y;
  dst[2] = b.x;
  dst[3] = b.y;
}

// What one lane reads of a token: q, k, g at the 4 key columns it prepares (4 lane .. 4 lane + 3),
// v at its 4 value rows, beta.
struct TokenInputs {
  uint2 q, k, g, v;
  uint16_t beta;
};

// Token row `row` of sequence n, whose batch row is known without a division: 0 for packed
// sequences (cu_seqlens, B = 1), n for [N, T] rows (ActivationView::row divides by T, a 64-bit
// division that cost five calls of ~70 instructions a token).
__device__ __forceinline__ int64_t batch_row(const RecurrentParams& p, int64_t n) {
  return p.seqs.cu_seqlens ? 0 : n;
}

template <bool kVector>
__device__ __forceinline__ TokenInputs load_token(const RecurrentParams& p, int64_t b, int64_t row, int h,
                                                  const LanePlace& at) {
  TokenInputs x;
  const uint16_t *q, *k, *g, *v;
  if (p.same_row_strides) {  // one offset (three 64-bit products) for the four rows
    const int64_t off = p.q.offset_in_batch(b, row, h);
    q = p.q.data + off, k = p.k.data + off, g = p.g.data + off, v = p.v.data + off;
  } else {
    q = p.q.row_in_batch(b, row, h), k = p.k.row_in_batch(b, row, h);
    g = p.g.row_in_batch(b, row, h), v = p.v.row_in_batch(b, row, h);
  }
  x.q = load4<kVector>(q + 4 * at.lane);
  x.k = load4<kVector>(k + 4 * at.lane);
  x.g = load4<kVector>(g + 4 * at.lane);
  x.v = load4<kVector>(v + at.v0);
  x.beta = *p.beta.row_in_batch(b, row, h);
  return x;
}

// A head's gate parameters at the 4 key columns a lane prepares.
struct HeadGate {
  float exp_a_log;
  float dt[4];  // dt_bias (4-byte aligned only: scalar loads)
};

__device__ __forceinline__ HeadGate head_gate(const RecurrentParams& p, int h, int lane) {
  HeadGate g;
  g.exp_a_log = expf(__ldg(p.A_log + h));
#pragma unroll
  for (int e = 0; e < 4; ++e) g.dt[e] = __ldg(p.dt_bias + h * kDim + 4 * lane + e);
  return g;
}

// Sum over the 8 lanes that share a row (lane bits 0-2).
__device__ __forceinline__ float row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  return x;
}

// Sums of a and b over the warp, side by side.
__device__ __forceinline__ void warp_sum2(float& a, float& b) {
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
}

// One token's normalised q (times the output scale), normalised k and decays exp(a), over the
// 128 key columns: each warp prepares its own copy (a lane 4 columns, no block barrier), double
// buffered by token parity, so a warp's lanes meet at one __syncwarp a token.
struct TokenPrep {
  float4 q[2][32], k[2][32], decay[2][32];
};

// One MUFU exp2 and one MUFU reciprocal, as the prep kernel's (fast_math.cuh): 1 / (1 + inf) = 0.
__device__ __forceinline__ float sigmoid(float x) { return ptx::rcp_ftz(1.f + ptx::exp2_ftz(-ptx::kLog2e * x)); }

// exp(a) of the gate's log-decay a, for g + dt_bias = x (docs/contract.md, both gates).
__device__ __forceinline__ float decay(float x, float exp_a_log, float lower_bound, bool softplus_gate) {
  if (!softplus_gate) return __expf(lower_bound * sigmoid(exp_a_log * x));
  const float sp = x > 20.f ? x + log1pf(__expf(-x)) : log1pf(__expf(x));
  return __expf(-exp_a_log * sp);
}

// One token on the lane's tile: this lane's 4 key columns of the token's prep into prep[buf] (the
// warp meets at one __syncwarp), then S' = Diag(exp(a)) S, u = beta (v - S'^T k), S = S' + k u^T
// and o = S^T q for the lane's 4 value rows (o[j] is complete on every lane of its row).
// before_read() runs right before the tile's first read (a packed tile is widened there), after the prep: the tile's registers need not be live during it. `buf` alternates
// between consecutive tokens of a warp.
template <typename BeforeRead>
__device__ __forceinline__ void token_step(const RecurrentParams& p, Tile& s, TokenPrep& prep, int buf,
                                           const TokenInputs& x, const HeadGate& gate, const LanePlace& at,
                                           float (&o)[kRowsPerLane], BeforeRead&& before_read) {
  {  // this lane's 4 columns of the token's prep
    float q[4], k[4], g[4];
    unpack4(x.q, q);
    unpack4(x.k, k);
    unpack4(x.g, g);
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sq = fmaf(q[e], q[e], sq);
      sk = fmaf(k[e], k[e], sk);
    }
    warp_sum2(sq, sk);
    const float rq = rsqrtf(sq + 1e-6f) * p.scale, rk = rsqrtf(sk + 1e-6f);  // the output scale folded into q
    prep.q[buf][at.lane] = make_float4(q[0] * rq, q[1] * rq, q[2] * rq, q[3] * rq);
    prep.k[buf][at.lane] = make_float4(k[0] * rk, k[1] * rk, k[2] * rk, k[3] * rk);
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = decay(g[e] + gate.dt[e], gate.exp_a_log, p.lower_bound, p.softplus_gate);
    prep.decay[buf][at.lane] = make_float4(d[0], d[1], d[2], d[3]);
  }
  __syncwarp();

  before_read();
  // This lane's 16 columns kl * 4 + 32 i + e: float4 i of the prep is lane kl + 8 i's.
  float kn[16];  // q is read from the prep where it is used: fewer live registers
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 b = prep.k[buf][at.kl + 8 * i], d = prep.decay[buf][at.kl + 8 * i];
    kn[4 * i] = b.x, kn[4 * i + 1] = b.y, kn[4 * i + 2] = b.z, kn[4 * i + 3] = b.w;
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j) {  // S' = Diag(exp(a)) S
      s[j][i][0] *= d.x;
      s[j][i][1] *= d.y;
      s[j][i][2] *= d.z;
      s[j][i][3] *= d.w;
    }
  }
  const float beta = sigmoid(__uint_as_float(uint32_t(x.beta) << 16));
  float v[4];
  unpack4(x.v, v);

#pragma unroll
  for (int j = 0; j < kRowsPerLane; ++j) {
    float pred = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) pred = fmaf(s[j][c / 4][c % 4], kn[c], pred);
    const float u = beta * (v[j] - row_sum(pred));  // beta (v - S'^T k)
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 q = prep.q[buf][at.kl + 8 * i];
      const float qc[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][i][e] = fmaf(u, kn[4 * i + e], s[j][i][e]);
        acc = fmaf(s[j][i][e], qc[e], acc);
      }
    }
    o[j] = row_sum(acc);
  }
}

// The lane's 4 values of out row `row` (one lane of the 8 of its rows writes them).
__device__ __forceinline__ void store_out(const RecurrentParams& p, const float (&o)[kRowsPerLane], int64_t row, int h,
                                          const LanePlace& at) {
  if (at.kl == 0)
    *reinterpret_cast<uint2*>(p.out + (row * p.num_heads + h) * int64_t{kDim} + at.v0) =
        make_uint2(ptx::pack_bf16x2(o[0], o[1]), ptx::pack_bf16x2(o[2], o[3]));
}

// The state after token t of sequence n to its per-token slot, when the call asks for one.
template <StateLayout L>
__device__ __forceinline__ void store_token_state(const RecurrentParams& p, Tile& s, int64_t n, int64_t t, int h,
                                                  const LanePlace& at) {
  if (!p.token_indices.data || !p.final_state || t >= p.token_columns) return;
  const int64_t slot = p.token_indices[n * p.token_columns + t];
  if (slot >= 0 && slot < p.slots.final_slots)
    store_tile<L>(s, head_state(p.final_state, p.final_bf16, slot, p.num_heads, h), p.final_bf16, at.v0, at.kl);
}

// The final state of sequence n (start slot `start`), unless per-token states replace it.
template <StateLayout L>
__device__ __forceinline__ void store_final_state(const RecurrentParams& p, Tile& s, int64_t n, int64_t start, int h,
                                                  const LanePlace& at) {
  if (!p.final_state || (p.token_indices.data && !p.slots.final.data)) return;
  const int64_t slot = p.slots.final_slot(n, start);
  if (slot >= 0)
    store_tile<L>(s, head_state(p.final_state, p.final_bf16, slot, p.num_heads, h), p.final_bf16, at.v0, at.kl);
}

template <StateLayout L>
__device__ __forceinline__ void write_checkpoints(const RecurrentParams& p, Tile& s, int64_t n, int h, int64_t tokens,
                                                  const LanePlace& at) {
  p.checkpoints.at(n, tokens, [&](int64_t entry) {
    store_tile<L>(s, p.checkpoints.states + (entry * p.num_heads + h) * int64_t{kStateElems}, false, at.v0, at.kl);
  });
}

}  // namespace flashkda::gpu::recurrent
