// The recurrent kernel: the per-token definition of docs/contract.md with the state in registers.
//
// A decode step is a streaming problem (read each state once, write it once), so the layout is
// chosen for the memory system: one block of 128 threads per (sequence, head, half of the value
// rows); each lane holds a 4 x 16 tile of its half, 4 value rows by 16 key columns, and the 8
// lanes that share rows hold all 128 columns between them, so every dot product over the key
// axis is 16 FMAs and three shuffles. Rows of the state are independent given the token's
// q, k, gate and beta, which each warp prepares for itself (TokenPrep: a lane 4 of the 128
// columns, in shared memory; no block barrier at all).
// When out is the very buffer of q, k, v or g (an exact alias the contract allows), one block of
// 256 threads takes the whole head and waits for all its lanes to have read a token before any
// writes that token's out row: blocks never share a row then.
// The tile's 16 four-element runs are contiguous in memory in both state layouts (V-major: along
// a row; K-major: along a column), so loads and stores are 16- or 8-byte vectors.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/decode/recurrent_params.h"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/fast_math.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kDim = 128;                   // K = V = 128
constexpr int kStateElems = kDim * kDim;    // one head's state
constexpr int kLanesPerRow = 8;             // lanes sharing a row, 16 key columns each
constexpr int kRowsPerLane = 4;
constexpr int kRowsPerWarp = 32 / kLanesPerRow * kRowsPerLane;
static_assert(kLanesPerRow * 16 == kDim, "the lanes of a row cover every key column");

// Warps of a block: 4 (half a head's value rows, two blocks a head) or 8 (the whole head).
template <int kWarps>
struct BlockShape {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static constexpr int kBlocksPerHead = kDim / kRows;
  static_assert(kBlocksPerHead * kRows == kDim, "the blocks of a head cover its value rows");
};

// A lane's state tile: s[j][i][e] = S[v0 + j][kl * 4 + 32 i + e] (value row, key column).
using Tile = float[kRowsPerLane][4][4];

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

// Issues the loads of the lane's tile. A bf16 tile arrives packed (each run's two bf16 pairs as
// the bit patterns of its first two elements) and is widened by widen_tile where first used: the
// loads stay in flight while the warp prepares the first token, instead of stalling it at an
// unpack instruction.
template <StateLayout L>
__device__ __forceinline__ void load_tile(Tile& s, const void* head_state, bool bf16, int v0, int kl) {
  if (bf16) {
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const uint2 raw =
          __ldcs(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(head_state) + Runs<L>::offset(r, v0, kl)));
      Runs<L>::at(s, r, 0) = __uint_as_float(raw.x);
      Runs<L>::at(s, r, 1) = __uint_as_float(raw.y);
    }
  } else {
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float4 raw =
          __ldcs(reinterpret_cast<const float4*>(static_cast<const float*>(head_state) + Runs<L>::offset(r, v0, kl)));
      Runs<L>::at(s, r, 0) = raw.x;
      Runs<L>::at(s, r, 1) = raw.y;
      Runs<L>::at(s, r, 2) = raw.z;
      Runs<L>::at(s, r, 3) = raw.w;
    }
  }
}

// A packed bf16 tile (load_tile) to fp32, in place.
template <StateLayout L>
__device__ __forceinline__ void widen_tile(Tile& s) {
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const float2 a = ptx::unpack_bf16x2(__float_as_uint(Runs<L>::at(s, r, 0)));
    const float2 b = ptx::unpack_bf16x2(__float_as_uint(Runs<L>::at(s, r, 1)));
    Runs<L>::at(s, r, 0) = a.x;
    Runs<L>::at(s, r, 1) = a.y;
    Runs<L>::at(s, r, 2) = b.x;
    Runs<L>::at(s, r, 3) = b.y;
  }
}

template <StateLayout L>
__device__ __forceinline__ void store_tile(Tile& s, void* head_state, bool bf16, int v0, int kl) {
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int off = Runs<L>::offset(r, v0, kl);
    const float x0 = Runs<L>::at(s, r, 0), x1 = Runs<L>::at(s, r, 1);
    const float x2 = Runs<L>::at(s, r, 2), x3 = Runs<L>::at(s, r, 3);
    if (bf16)
      __stcs(reinterpret_cast<uint2*>(static_cast<uint16_t*>(head_state) + off),
             make_uint2(ptx::pack_bf16x2(x0, x1), ptx::pack_bf16x2(x2, x3)));
    else
      __stcs(reinterpret_cast<float4*>(static_cast<float*>(head_state) + off), make_float4(x0, x1, x2, x3));
  }
}

// Four consecutive bf16 values; one 8-byte load when the row is aligned for it.
__device__ __forceinline__ uint2 load4(const uint16_t* x, bool vector) {
  if (vector) return *reinterpret_cast<const uint2*>(x);
  return make_uint2(uint32_t(x[0]) | uint32_t(x[1]) << 16, uint32_t(x[2]) | uint32_t(x[3]) << 16);
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

__device__ __forceinline__ TokenInputs load_token(const RecurrentParams& p, int64_t row, int h, int v0, int lane) {
  TokenInputs x;
  x.q = load4(p.q.row(row, h) + 4 * lane, p.vector_loads);
  x.k = load4(p.k.row(row, h) + 4 * lane, p.vector_loads);
  x.g = load4(p.g.row(row, h) + 4 * lane, p.vector_loads);
  x.v = load4(p.v.row(row, h) + v0, p.vector_loads);
  x.beta = *p.beta.row(row, h);
  return x;
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

template <StateLayout L>
__device__ __forceinline__ void write_checkpoints(const RecurrentParams& p, Tile& s, int64_t n, int h, int64_t tokens,
                                                  int v0, int kl) {
  p.checkpoints.at(n, tokens, [&](int64_t entry) {
    store_tile<L>(s, p.checkpoints.states + (entry * p.num_heads + h) * int64_t{kStateElems}, false, v0, kl);
  });
}

// At most 128 registers (no spills): 4 blocks of 4 warps a multiprocessor. A decode step is
// latency-bound per block (load the tile, a chain of dependent arithmetic and shuffles, store),
// so warps in flight matter more than anything else here.
template <StateLayout L, int kWarps>
__global__ void __launch_bounds__(BlockShape<kWarps>::kThreads, 16 / kWarps) recurrent_kernel(const RecurrentParams p) {
  using Shape = BlockShape<kWarps>;
  const int64_t item = blockIdx.x / Shape::kBlocksPerHead;  // (sequence, head)
  const int64_t n = item / p.num_heads;
  const int h = static_cast<int>(item % p.num_heads);
  const int lane = threadIdx.x % 32, kl = lane % kLanesPerRow;
  const int v0 = (blockIdx.x % Shape::kBlocksPerHead) * Shape::kRows + (threadIdx.x / kLanesPerRow) * kRowsPerLane;

  const int64_t start = p.slots.start(n);
  if (!p.slots.runs(start, p.initial_state != nullptr)) return;  // padding: nothing is written for it
  const int64_t final_slot = p.token_indices.data && !p.slots.final.data ? -1 : p.slots.final_slot(n, start);
  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);

  // The first token's inputs, then the tile: the token's prep runs while the tile is in flight.
  const int64_t len = eos - bos;
  TokenInputs next;
  if (len > 0) next = load_token(p, bos, h, v0, lane);
  const float exp_a_log = expf(__ldg(p.A_log + h));
  float dt[4];  // dt_bias at the 4 columns this lane prepares (4-byte aligned only: scalar loads)
#pragma unroll
  for (int e = 0; e < 4; ++e) dt[e] = __ldg(p.dt_bias + h * kDim + 4 * lane + e);

  Tile s;
  bool packed = false;  // s holds a packed bf16 tile until widen_tile
  if (p.initial_state) {
    const int64_t elem = p.initial_bf16 ? 2 : 4;
    load_tile<L>(s, static_cast<const char*>(p.initial_state) + (start * p.num_heads + h) * int64_t{kStateElems} * elem,
                 p.initial_bf16, v0, kl);
    packed = p.initial_bf16;
  } else {
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][i][e] = 0.f;
  }
  auto widen = [&] {
    if (packed) widen_tile<L>(s);
    packed = false;
  };

  __shared__ TokenPrep prep_of_warp[Shape::kThreads / 32];
  TokenPrep& prep = prep_of_warp[threadIdx.x / 32];
  const int64_t final_elem = p.final_bf16 ? 2 : 4;
  for (int64_t t = 0; t < len; ++t) {
    if (p.checkpoints.count > 0 && t % 16 == 0) {
      widen();
      write_checkpoints<L>(p, s, n, h, t, v0, kl);
    }
    const TokenInputs x = next;
    if (t + 1 < len) next = load_token(p, bos + t + 1, h, v0, lane);  // in flight during this token

    const int buf = static_cast<int>(t & 1);
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
      prep.q[buf][lane] = make_float4(q[0] * rq, q[1] * rq, q[2] * rq, q[3] * rq);
      prep.k[buf][lane] = make_float4(k[0] * rk, k[1] * rk, k[2] * rk, k[3] * rk);
      float d[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) d[e] = decay(g[e] + dt[e], exp_a_log, p.lower_bound, p.softplus_gate);
      prep.decay[buf][lane] = make_float4(d[0], d[1], d[2], d[3]);
    }
    __syncwarp();

    widen();
    // This lane's 16 columns kl * 4 + 32 i + e: float4 i of the prep is lane kl + 8 i's.
    float kn[16];  // q is read from the prep where it is used: fewer live registers
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 b = prep.k[buf][kl + 8 * i], d = prep.decay[buf][kl + 8 * i];
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

    float o[kRowsPerLane];
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j) {
      float pred = 0.f;
#pragma unroll
      for (int c = 0; c < 16; ++c) pred = fmaf(s[j][c / 4][c % 4], kn[c], pred);
      const float u = beta * (v[j] - row_sum(pred));  // beta (v - S'^T k)
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 q = prep.q[buf][kl + 8 * i];
        const float qc[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][i][e] = fmaf(u, kn[4 * i + e], s[j][i][e]);
          acc = fmaf(s[j][i][e], qc[e], acc);
        }
      }
      o[j] = row_sum(acc);
    }
    if constexpr (Shape::kBlocksPerHead == 1) __syncthreads();  // every lane has read this token's row
    if (kl == 0)
      *reinterpret_cast<uint2*>(p.out + ((bos + t) * p.num_heads + h) * int64_t{kDim} + v0) =
          make_uint2(ptx::pack_bf16x2(o[0], o[1]), ptx::pack_bf16x2(o[2], o[3]));
    if (p.token_indices.data && p.final_state && t < p.token_columns) {
      const int64_t slot = p.token_indices[n * p.token_columns + t];
      if (slot >= 0 && slot < p.slots.final_slots)
        store_tile<L>(s, static_cast<char*>(p.final_state) + (slot * p.num_heads + h) * int64_t{kStateElems} * final_elem,
                      p.final_bf16, v0, kl);
    }
  }
  widen();  // a sequence without tokens
  if (p.checkpoints.count > 0 && len % 16 == 0) write_checkpoints<L>(p, s, n, h, len, v0, kl);
  if (p.final_state && final_slot >= 0)
    store_tile<L>(s, static_cast<char*>(p.final_state) + (final_slot * p.num_heads + h) * int64_t{kStateElems} * final_elem,
                  p.final_bf16, v0, kl);
}

}  // namespace

namespace {
template <int kWarps>
void launch(const RecurrentParams& p, StateLayout layout, cudaStream_t stream) {
  using Shape = BlockShape<kWarps>;
  const int64_t blocks = p.seqs.num_seqs * p.num_heads * Shape::kBlocksPerHead;
  if (blocks == 0) return;
  const auto kernel = layout == StateLayout::kVK ? recurrent_kernel<StateLayout::kVK, kWarps>
                                                 : recurrent_kernel<StateLayout::kKV, kWarps>;
  kernel<<<static_cast<unsigned>(blocks), Shape::kThreads, 0, stream>>>(p);
}
}  // namespace

void launch_recurrent(const RecurrentParams& p, StateLayout layout, cudaStream_t stream) {
  if (p.out_aliases_input) launch<8>(p, layout, stream);
  else launch<4>(p, layout, stream);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    fail(ErrorCode::kCudaError, "launching the recurrent kernel: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
