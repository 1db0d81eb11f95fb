// Prep kernel: everything of a chunk that does not depend on the state, one block per
// (chunk slot, head), thread c owning key channel c (and value channel c).
#include <cuda_runtime.h>

#include "api/validate.h"
#include "common/bf16.h"
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/convert.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kThreads = 128;

// One butterfly level: lanes with bit `kWidth` set keep the upper half of x[0, 2 kWidth), the others
// the lower half, each adding its partner's copy. Widths are template arguments so every index is a
// compile-time constant and x stays in registers.
template <int kWidth>
__device__ __forceinline__ void butterfly_level(float (&x)[32], int lane) {
  const bool upper = lane & kWidth;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {
    const float first = x[i], second = x[i + kWidth];
    const float send = upper ? first : second;
    const float keep = upper ? second : first;
    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, kWidth);
  }
}

// Warp reduce-scatter: lane l ends with the warp-wide sum of x[l]. 31 shuffles for 32 sums.
__device__ __forceinline__ float reduce_scatter_32(float (&x)[32], int lane) {
  butterfly_level<16>(x, lane);
  butterfly_level<8>(x, lane);
  butterfly_level<4>(x, lane);
  butterfly_level<2>(x, lane);
  butterfly_level<1>(x, lane);
  return x[0];
}

// Finds the chunk a slot holds: its first token and token count (0 for an unused slot).
__device__ __forceinline__ void locate_slot(const SequenceTable& seqs, int64_t slot, int64_t& t0, int& count) {
  int64_t lo = 0, hi = seqs.num_seqs - 1;  // largest n with first_slot(n) <= slot
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (seqs.first_slot(mid, seqs.offset(mid)) <= slot) lo = mid;
    else hi = mid - 1;
  }
  int64_t bos, eos;
  seqs.bounds(lo, bos, eos);
  const int64_t chunk = slot - seqs.first_slot(lo, bos);
  t0 = bos + chunk * kChunk;
  count = (chunk < 0 || t0 >= eos) ? 0 : static_cast<int>(eos - t0 < kChunk ? eos - t0 : kChunk);
}

// Strictly lower pair p in [0, 120) -> (i, j), i > j, row-major: p = i (i - 1) / 2 + j.
__device__ __forceinline__ void lower_pair(int p, int& i, int& j) {
  i = 1;
  while ((i + 1) * i / 2 <= p) ++i;  // once per thread, at most 15 steps
  j = p - i * (i - 1) / 2;
}

constexpr int kTileStride = kHeadDim + 4;  // fp32 rows padded by 16 bytes: row i starts in bank 4i

// Shared memory. The input tiles, the fp32 scratch tiles and the outgoing record live in one
// buffer, in turn (each phase ends at a __syncthreads before the next one writes).
struct PrepSmem {
  union {
    uint16_t in[3][kChunk][kHeadDim];               // q, k, g rows as loaded (bf16)
    float tile[3][kChunk][kTileStride];             // K~, K-, Q~ (fp32)
    uint8_t record[ChunkRecord::kBytes];            // staged record, stored with one bulk copy
  };
  uint16_t v[kChunk][kHeadDim];                     // v rows (bf16), read again for W V at the end
  float red[kThreads / 32][32];
  float rnorm[2 * kChunk];                           // 1/||q_t||, then 1/||k_t||
  float beta[kChunk];
  alignas(16) float L[kChunk][kChunk];
  alignas(16) float M[kChunk][kChunk];
  alignas(16) float W[kChunk][kChunk];
};

// sum_j A[i][j] x[j] over a lower-triangular row (zeros above the diagonal), 4 columns a read.
__device__ __forceinline__ float lower_row_dot(const float (&row)[kChunk], const float (&x)[kChunk], int i) {
  float s = 0.0f;
#pragma unroll
  for (int j4 = 0; j4 < kChunk / 4; ++j4) {
    if (4 * j4 > i) break;
    const float4 a = *reinterpret_cast<const float4*>(&row[4 * j4]);
    s = fmaf(a.x, x[4 * j4], s);
    s = fmaf(a.y, x[4 * j4 + 1], s);
    s = fmaf(a.z, x[4 * j4 + 2], s);
    s = fmaf(a.w, x[4 * j4 + 3], s);
  }
  return s;
}

__global__ void __launch_bounds__(kThreads) prep_kernel(const PrepParams p) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y;
  int64_t t0;
  int count;
  locate_slot(p.seqs, slot, t0, count);
  if (count == 0) return;  // uniform over the block

  __shared__ __align__(128) PrepSmem sm;
  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;
  const int H = p.num_heads;

  // Phase 1: the chunk's q, k, g, v rows into shared memory with 16-byte loads (rows past the
  // sequence end are zero), beta's sigmoid (0 for padding: those tokens then change nothing).
  {
    const uint16_t* src[4] = {p.q, p.k, p.g, p.v};
    uint4 x[4][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = c + r * kThreads, row = idx >> 4, seg = idx & 15;
      const int64_t offset = ((t0 + row) * H + h) * kHeadDim + seg * 8;
#pragma unroll
      for (int m = 0; m < 4; ++m)
        x[m][r] = row < count ? __ldg(reinterpret_cast<const uint4*>(src[m] + offset)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int idx = c + r * kThreads, row = idx >> 4, seg = idx & 15;
#pragma unroll
      for (int m = 0; m < 4; ++m) *reinterpret_cast<uint4*>(m < 3 ? &sm.in[m][row][seg * 8] : &sm.v[row][seg * 8]) = x[m][r];
    }
    if (c < kChunk) {
      const float b = c < count ? bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(p.beta) + (t0 + c) * H + h)) : 0.0f;
      sm.beta[c] = c < count ? 1.0f / (1.0f + __expf(-b)) : 0.0f;
    }
  }
  __syncthreads();

  // Phase 2: thread c takes key channel c (and value channel c) of the 16 tokens.
  float q[kChunk], k[kChunk], G[kChunk];
  {
    const float expA = __expf(__ldg(p.A_log + h));
    const float bias = __ldg(p.dt_bias + h * kHeadDim + c);
    float run = 0.0f;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      q[t] = bf16_to_float(sm.in[0][t][c]);
      k[t] = bf16_to_float(sm.in[1][t][c]);
      // safe gate a = lower_bound * sigmoid(exp(A_log) (g + dt_bias)); padding rows: a = 0
      const float x = expA * (bf16_to_float(sm.in[2][t][c]) + bias);
      const float a = t < count ? __fdividef(p.lower_bound, 1.0f + __expf(-x)) : 0.0f;
      G[t] = (run += a);  // cumulative log-decay G_t
    }
    float sq[32];  // L2 norms of the 16 q rows and 16 k rows, reduced over the 128 channels
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      sq[t] = q[t] * q[t];
      sq[kChunk + t] = k[t] * k[t];
    }
    sm.red[warp][lane] = reduce_scatter_32(sq, lane);
  }
  __syncthreads();  // also: every thread is done reading sm.in
  if (c < 2 * kChunk) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += sm.red[w][c];
    sm.rnorm[c] = rsqrtf(total + 1e-6f);
  }
  __syncthreads();

  // Decayed rows: k~ = k^ e^G, k- = k^ e^-G (|G| <= 80 for the safe gate), q~ = scale q^ e^G,
  // kr = k^ e^(G_C - G). k and q become k~ and q~ in place.
  const float e_C = __expf(G[kChunk - 1]);  // decay of the whole chunk, exp(G_C)
  float kr[kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    const float kh = k[t] * sm.rnorm[kChunk + t];
    const float e = __expf(G[t]), e_inv = __expf(-G[t]);
    kr[t] = kh * (e_C * e_inv);
    k[t] = kh * e;
    q[t] = p.scale * q[t] * sm.rnorm[t] * e;
    sm.tile[0][t][c] = k[t];
    sm.tile[1][t][c] = kh * e_inv;
    sm.tile[2][t][c] = q[t];
  }
  __syncthreads();

  // L (strictly lower, times beta_i) and M (lower incl. diagonal) as fp32 dot products over the
  // 128 channels: threads 0..119 take one strictly-lower pair (both L and M), threads 120..127
  // two diagonal entries of M each; every thread reads 3-4 float4 per 4 channels.
  if (c < 120) {
    int i, j;
    lower_pair(c, i, j);
    float l = 0.0f, m = 0.0f;
#pragma unroll 8
    for (int c4 = 0; c4 < kHeadDim; c4 += 4) {
      const float4 a = *reinterpret_cast<const float4*>(&sm.tile[0][i][c4]);
      const float4 b = *reinterpret_cast<const float4*>(&sm.tile[1][j][c4]);
      const float4 e = *reinterpret_cast<const float4*>(&sm.tile[2][i][c4]);
      l = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, l))));
      m = fmaf(e.x, b.x, fmaf(e.y, b.y, fmaf(e.z, b.z, fmaf(e.w, b.w, m))));
    }
    sm.L[i][j] = sm.beta[i] * l;
    sm.M[i][j] = m;
    sm.L[j][i] = sm.M[j][i] = 0.0f;
  } else {
    const int i0 = 2 * (c - 120), i1 = i0 + 1;
    float m0 = 0.0f, m1 = 0.0f;
#pragma unroll 8
    for (int c4 = 0; c4 < kHeadDim; c4 += 4) {
      const float4 a0 = *reinterpret_cast<const float4*>(&sm.tile[2][i0][c4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&sm.tile[1][i0][c4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&sm.tile[2][i1][c4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&sm.tile[1][i1][c4]);
      m0 = fmaf(a0.x, b0.x, fmaf(a0.y, b0.y, fmaf(a0.z, b0.z, fmaf(a0.w, b0.w, m0))));
      m1 = fmaf(a1.x, b1.x, fmaf(a1.y, b1.y, fmaf(a1.z, b1.z, fmaf(a1.w, b1.w, m1))));
    }
    sm.M[i0][i0] = m0;
    sm.M[i1][i1] = m1;
    sm.L[i0][i0] = sm.L[i1][i1] = 0.0f;
  }
  __syncthreads();

  // W = (I + L)^{-1} Diag(beta): thread j solves column j by forward substitution.
  if (c < kChunk) {
    const int j = c;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s = (i == j) ? 1.0f : 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m) s = fmaf(-sm.L[i][m], x[m], s);
      x[i] = (i < j) ? 0.0f : s;
    }
    const float bj = sm.beta[j];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) sm.W[i][j] = x[i] * bj;
  }
  __syncthreads();  // also: the fp32 tiles are dead from here on; the record is staged over them

  // Record tiles for channel c: Wk = W K~, (W V)^T, Qe = Q~ - M Wk, Kr^T, M, exp(G_C).
  float* rec = reinterpret_cast<float*>(sm.record);
  float wk[kChunk], v[kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) v[t] = bf16_to_float(sm.v[t][c]);
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    wk[i] = lower_row_dot(sm.W[i], k, i);
    rec[ChunkRecord::kWk / 4 + swizzle_128(i, c)] = ptx::round_tf32(wk[i]);
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i)
    rec[ChunkRecord::kQe / 4 + swizzle_128(i, c)] = ptx::round_tf32(q[i] - lower_row_dot(sm.M[i], wk, i));
  // Rows of 16 tokens for channel c: the swizzle keeps aligned groups of 4, so float4 stores.
#pragma unroll
  for (int t = 0; t < kChunk; t += 4) {
    *reinterpret_cast<float4*>(&rec[ChunkRecord::kKr / 4 + swizzle_16(c, t)]) =
        make_float4(ptx::round_tf32(kr[t]), ptx::round_tf32(kr[t + 1]), ptx::round_tf32(kr[t + 2]),
                    ptx::round_tf32(kr[t + 3]));
    *reinterpret_cast<float4*>(&rec[ChunkRecord::kWV / 4 + swizzle_16(c, t)]) =
        make_float4(lower_row_dot(sm.W[t], v, t), lower_row_dot(sm.W[t + 1], v, t + 1),
                    lower_row_dot(sm.W[t + 2], v, t + 2), lower_row_dot(sm.W[t + 3], v, t + 3));
  }
  for (int idx = c; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    rec[ChunkRecord::kM / 4 + swizzle_16(i, j)] = ptx::round_tf32(sm.M[i][j]);
  }
  rec[ChunkRecord::kDecay / 4 + c] = e_C;

  // Hand the staged record to the copy engine: one bulk store of 25 KB.
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (c == 0) {
    uint8_t* dst = p.records + (slot * H + h) * static_cast<int64_t>(ChunkRecord::kBytes);
    ptx::bulk_copy_s2g(dst, sm.record, ChunkRecord::kBytes);
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read_all();
  }
}

}  // namespace

void launch_prep(const PrepParams& p, int64_t num_slots, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_slots), static_cast<unsigned>(p.num_heads));
  prep_kernel<<<grid, kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "prep kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
