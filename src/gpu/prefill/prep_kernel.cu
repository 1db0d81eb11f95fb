// Prep kernel: everything of a chunk that does not depend on the state, one block per
// (chunk slot, head), thread c owning key channel c (and value channel c).
#include <cuda_runtime.h>

#include "api/validate.h"
#include "common/bf16.h"
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/bulk_copy.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kThreads = 128;
constexpr int kPairs = kChunk * (kChunk + 1) / 2;  // (i, j) with j <= i
constexpr int kRowPad = kHeadDim + 1;              // fp32 rows padded: row i, column c in bank (i + c) % 32

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

__device__ __forceinline__ float load_bf16(const uint16_t* p) {
  return bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
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

__global__ void __launch_bounds__(kThreads) prep_kernel(const PrepParams p) {
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y;
  int64_t t0;
  int count;
  locate_slot(p.seqs, slot, t0, count);
  if (count == 0) return;  // uniform over the block

  // Scratch (three fp32 [16][129] tiles) aliases the record staging area: the tiles are dead
  // before the record is written (a __syncthreads separates them).
  __shared__ __align__(128) uint8_t s_record[ChunkRecord::kBytes];
  static_assert(3 * kChunk * kRowPad * 4 <= ChunkRecord::kBytes, "scratch must fit the record");
  float(*s_kt)[kRowPad] = reinterpret_cast<float(*)[kRowPad]>(s_record);        // K~  [16][128]
  float(*s_km)[kRowPad] = s_kt + kChunk;                                          // K-  [16][128]
  float(*s_qt)[kRowPad] = s_kt + 2 * kChunk;                                      // Q~  [16][128]
  __shared__ float s_red[kThreads / 32][32];
  __shared__ float s_rnorm[2 * kChunk];  // 1/||q_t||, then 1/||k_t||
  __shared__ float s_beta[kChunk];
  __shared__ float s_L[kChunk][kChunk + 1];
  __shared__ float s_M[kChunk][kChunk + 1];
  __shared__ float s_W[kChunk][kChunk + 1];

  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;
  const int H = p.num_heads;

  float q[kChunk], k[kChunk], v[kChunk], a[kChunk];
  const float expA = __expf(__ldg(p.A_log + h));
  const float bias = __ldg(p.dt_bias + h * kHeadDim + c);
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < count) {
      const int64_t base = ((t0 + t) * H + h) * kHeadDim + c;
      q[t] = load_bf16(p.q + base);
      k[t] = load_bf16(p.k + base);
      v[t] = load_bf16(p.v + base);
      const float x = expA * (load_bf16(p.g + base) + bias);
      a[t] = p.lower_bound / (1.0f + __expf(-x));  // safe gate: lower_bound * sigmoid(x)
    } else {
      q[t] = k[t] = v[t] = a[t] = 0.0f;  // padding tokens contribute nothing
    }
  }
  if (c < kChunk) {
    const float b = c < count ? load_bf16(p.beta + (t0 + c) * H + h) : 0.0f;
    s_beta[c] = c < count ? 1.0f / (1.0f + __expf(-b)) : 0.0f;
  }

  {  // L2 norms of the 16 q rows and 16 k rows, reduced over the 128 channels
    float sq[32];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      sq[t] = q[t] * q[t];
      sq[kChunk + t] = k[t] * k[t];
    }
    s_red[warp][lane] = reduce_scatter_32(sq, lane);
  }
  __syncthreads();
  if (c < 2 * kChunk) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += s_red[w][c];
    s_rnorm[c] = rsqrtf(total + 1e-6f);
  }
  __syncthreads();

  // Cumulative log-decay G_t and the decayed key/query rows.
  float G[kChunk];
  float run = 0.0f;
#pragma unroll
  for (int t = 0; t < kChunk; ++t) G[t] = (run += a[t]);
  const float G_C = G[kChunk - 1];
  float kt[kChunk], qt[kChunk], kr[kChunk];
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    const float kh = k[t] * s_rnorm[kChunk + t];
    const float e = __expf(G[t]);
    kt[t] = kh * e;                       // k~ = k^ exp(G)
    qt[t] = p.scale * q[t] * s_rnorm[t] * e;  // q~ = scale q^ exp(G)
    kr[t] = kh * __expf(G_C - G[t]);      // kr = k^ exp(G_C - G)
    s_kt[t][c] = kt[t];
    s_km[t][c] = kh * __expf(-G[t]);      // k- = k^ exp(-G); |G| <= 80 for the safe gate
    s_qt[t][c] = qt[t];
  }
  __syncthreads();

  // L (strictly lower, times beta_i) and M (lower incl. diagonal), fp32 dot products.
  for (int pair = c; pair < kPairs; pair += kThreads) {
    int i = static_cast<int>((sqrtf(8.0f * pair + 1.0f) - 1.0f) * 0.5f);
    while (i * (i + 1) / 2 > pair) --i;
    while ((i + 1) * (i + 2) / 2 <= pair) ++i;
    const int j = pair - i * (i + 1) / 2;
    float l = 0.0f, m = 0.0f;
#pragma unroll 8
    for (int cc = 0; cc < kHeadDim; ++cc) {
      const float km = s_km[j][cc];
      l = fmaf(s_kt[i][cc], km, l);
      m = fmaf(s_qt[i][cc], km, m);
    }
    s_L[i][j] = i > j ? s_beta[i] * l : 0.0f;
    s_M[i][j] = m;
  }
  for (int idx = c; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    if (j > i) s_L[i][j] = s_M[i][j] = 0.0f;
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
      for (int m = 0; m < i; ++m) s = fmaf(-s_L[i][m], x[m], s);
      x[i] = (i < j) ? 0.0f : s;
    }
    const float bj = s_beta[j];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) s_W[i][j] = x[i] * bj;
  }
  __syncthreads();

  // Record tiles for channel c. (The scratch tiles above are dead from here on.)
  float wk[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    float s = 0.0f, wv = 0.0f;
#pragma unroll
    for (int j = 0; j <= i; ++j) {
      s = fmaf(s_W[i][j], kt[j], s);
      wv = fmaf(s_W[i][j], v[j], wv);
    }
    wk[i] = s;
    reinterpret_cast<float*>(s_record + ChunkRecord::kWV)[c * kChunk + i] = wv;
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    float qe = qt[i];
#pragma unroll
    for (int j = 0; j <= i; ++j) qe = fmaf(-s_M[i][j], wk[j], qe);
    const uint16_t kr_hi = float_to_bf16(kr[i]);
    const uint32_t off = tile_offset(i, c);
    *reinterpret_cast<uint16_t*>(s_record + ChunkRecord::kWk + off) = float_to_bf16(wk[i]);
    *reinterpret_cast<uint16_t*>(s_record + ChunkRecord::kQe + off) = float_to_bf16(qe);
    *reinterpret_cast<uint16_t*>(s_record + ChunkRecord::kKrHi + off) = kr_hi;
    *reinterpret_cast<uint16_t*>(s_record + ChunkRecord::kKrLo + off) = float_to_bf16(kr[i] - bf16_to_float(kr_hi));
  }
  for (int idx = c; idx < kChunk * kChunk; idx += kThreads)
    reinterpret_cast<uint16_t*>(s_record + ChunkRecord::kM)[idx] = float_to_bf16(s_M[idx / kChunk][idx % kChunk]);
  reinterpret_cast<float*>(s_record + ChunkRecord::kDecay)[c] = __expf(G_C);

  // Hand the staged record to the copy engine: one bulk store of 25 KB.
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (c == 0) {
    uint8_t* dst = p.records + (slot * H + h) * static_cast<int64_t>(ChunkRecord::kBytes);
    ptx::bulk_copy_s2g(dst, s_record, ChunkRecord::kBytes);
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
