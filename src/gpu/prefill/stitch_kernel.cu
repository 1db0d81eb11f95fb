// Stitch kernel: combines the runs of the split state pass (state_kernel.cu, kSplit), which are
// linear in the state S_{s-1} where segment s starts:
//   S_s^T  = B_s^T + S_{s-1}^T A_s^T                                     (Y = Z + X M)
//   out[t] = out_b[t] + out_a[t] S_{s-1}   for the rows t of segment s   (Y = Z + X M^T, M = S_{s-1}^T)
#include <cuda_runtime.h>

#include <type_traits>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/mma.cuh"
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::gpu {
namespace {

// One block: 64 rows of one head against a 128 x 128 M, on the tensor cores in 3xTF32
// (X M = Xhi Mhi + Xhi Mlo + Xlo Mhi, m16n8k8 tf32 products with fp32 accumulators: about fp32's
// accuracy, where plain tf32 would add ~5e-4 to out when the state is large), or in 2xTF32 for
// the out rows (X = out_a rounded to the nearest tf32, M = S_{s-1}^T split: X's rounding alone,
// ~2^-12 relative, as the state pass's own products round S; the chain of states keeps 3xTF32,
// its errors carry into every later segment). 8 warps over a tile of kTileRows rows (RowTiling:
// 64 rows: warp w takes rows 16 (w / 2) .. +15 and the n-tiles of half w % 2). X and M are
// stored as loaded (fp32, 104 KB: two blocks a multiprocessor, so one block's loads overlap the
// other's products) and split into hi + lo in registers. ncu at 189cc93 (P8): the FMA version spent 40 us on each
// chain step (4 blocks) and 340 us on the out rows at 0.85 TB/s, stalled on loads with one
// block a multiprocessor.
constexpr int kWarps = 8;
constexpr int kRows = 64;
constexpr int kThreads = kWarps * 32;
// Row strides in floats. X and M^T [n][k] (kTransposed) are read as 8-byte pairs along a row:
// + 8 puts row r in bank 8r, so rows g = 0..3 of a half-warp never collide. M [k][n] is read as
// single words down two rows: + 4 puts rows 2t (t = 0..3) in banks 8t, 8t + 1, ...
constexpr int kPairStride = kHeadDim + 8;
constexpr int kWordStride = kHeadDim + 4;

// How 8 warps share a tile of kTileRows rows x 128 columns: the 16-row slabs (one mma row
// block each) get kWarpsPerSlab warps, each taking kNTiles n-tiles of 8 columns. Every output
// entry is one accumulator summed over k in the same order whatever the tiling, so the tilings
// give the same results bit for bit.
template <int kTileRows>
struct RowTiling {
  static constexpr int kSlabs = kTileRows / 16;
  static constexpr int kWarpsPerSlab = kWarps / kSlabs;
  static constexpr int kNTiles = kHeadDim / 8 / kWarpsPerSlab;  // n-tiles of one warp
  static_assert(kTileRows % 16 == 0 && kWarps % kSlabs == 0 && kHeadDim / 8 % kWarpsPerSlab == 0,
                "whole slabs, whole n-tiles");
};

template <int kTileRows>
struct StitchSmemOf {
  float x[kTileRows][kPairStride];
  float m[kHeadDim][kPairStride];  // as stored: M^T [n][k] (kTransposed) or M [k][n]
};
using StitchSmem = StitchSmemOf<kRows>;

__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// hi (the tf32 value nearest x) and lo = x - hi, as mma operand bits. A NaN that hi drops stays in lo.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  const float h = ptx::tf32_high_part(x);
  hi = __float_as_uint(h);
  lo = __float_as_uint(x - h);
}

constexpr int kNTiles = RowTiling<kRows>::kNTiles;  // n-tiles of one warp in a 64-row tile

// Loads as float4 v of thread tid at tid + v kThreads: M's [128][128] and the kTileRows rows of X.
constexpr int kMVectors = kHeadDim * kHeadDim / 4 / kThreads;
template <int kTileRows>
constexpr int kXVectors = kTileRows * kHeadDim / 4 / kThreads;
constexpr int kRowVectors = kHeadDim / 4;

__device__ __forceinline__ void load_m(const float* m, float4 (&mv)[kMVectors], int tid) {
#pragma unroll
  for (int v = 0; v < kMVectors; ++v) mv[v] = reinterpret_cast<const float4*>(m)[tid + v * kThreads];
}

// Rows row0 .. row0 + kTileRows - 1 of X (zeros from row_end on).
template <int kTileRows>
__device__ __forceinline__ void load_x_rows(const float* x, int64_t row_stride, int64_t row0, int64_t row_end,
                                            float4 (&xv)[kXVectors<kTileRows>], int tid) {
#pragma unroll
  for (int v = 0; v < kXVectors<kTileRows>; ++v) {
    const int i = tid + v * kThreads;
    const int64_t row = row0 + i / kRowVectors;
    xv[v] = row < row_end ? *reinterpret_cast<const float4*>(x + row * row_stride + 4 * (i % kRowVectors))
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

template <int kMStride>
__device__ __forceinline__ void store_m(const float4 (&mv)[kMVectors], float (*m_tile)[kMStride], int tid) {
#pragma unroll
  for (int v = 0; v < kMVectors; ++v) {
    const int i = tid + v * kThreads;
    *reinterpret_cast<float4*>(&m_tile[i / kRowVectors][4 * (i % kRowVectors)]) = mv[v];
  }
}

template <int kTileRows>
__device__ __forceinline__ void store_x_rows(const float4 (&xv)[kXVectors<kTileRows>],
                                             float (&x)[kTileRows][kPairStride], int tid) {
#pragma unroll
  for (int v = 0; v < kXVectors<kTileRows>; ++v) {
    const int i = tid + v * kThreads;
    *reinterpret_cast<float4*>(&x[i / kRowVectors][4 * (i % kRowVectors)]) = xv[v];
  }
}

// acc = X M (3xTF32; 2xTF32 without kSplitX) for the block's kTileRows rows in x, the warp's
// share as RowTiling deals it (FragmentPlace). m_tile: M^T [n][k] (kTransposed) or M [k][n].
template <int kMStride, bool kTransposed, bool kSplitX, int kTileRows>
__device__ __forceinline__ void multiply_rows(const float (&x)[kTileRows][kPairStride], const float (*m_tile)[kMStride],
                                              int warp, int lane, float (&acc)[RowTiling<kTileRows>::kNTiles][4]) {
  constexpr int kNTiles = RowTiling<kTileRows>::kNTiles;
  // k-slot t = element 2t, t + 4 = element 2t + 1 of each k-tile (mma.cuh).
  const int g = lane >> 2, t4 = lane & 3;
  constexpr int kWarpsPerSlab = RowTiling<kTileRows>::kWarpsPerSlab;
  const int r0 = 16 * (warp / kWarpsPerSlab), nt0 = kNTiles * (warp % kWarpsPerSlab);
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll 2
  for (int k0 = 0; k0 < kHeadDim; k0 += 8) {
    const float2 top = load2(&x[r0 + g][k0 + 2 * t4]);
    const float2 bottom = load2(&x[r0 + g + 8][k0 + 2 * t4]);
    uint32_t a_hi[4], a_lo[4];
    if constexpr (kSplitX) {
      split_tf32(top.x, a_hi[0], a_lo[0]);
      split_tf32(bottom.x, a_hi[1], a_lo[1]);
      split_tf32(top.y, a_hi[2], a_lo[2]);
      split_tf32(bottom.y, a_hi[3], a_lo[3]);
    } else {
      a_hi[0] = __float_as_uint(ptx::tf32_high_part(top.x));
      a_hi[1] = __float_as_uint(ptx::tf32_high_part(bottom.x));
      a_hi[2] = __float_as_uint(ptx::tf32_high_part(top.y));
      a_hi[3] = __float_as_uint(ptx::tf32_high_part(bottom.y));
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int n = 8 * (nt0 + j) + g;
      const float2 b = kTransposed ? load2(&m_tile[n][k0 + 2 * t4])
                                   : make_float2(m_tile[k0 + 2 * t4][n], m_tile[k0 + 2 * t4 + 1][n]);
      uint32_t b_hi[2], b_lo[2];
      split_tf32(b.x, b_hi[0], b_lo[0]);
      split_tf32(b.y, b_hi[1], b_lo[1]);
      if constexpr (kSplitX) ptx::mma_tf32_1688(acc[j], a_lo, __uint_as_float(b_hi[0]), __uint_as_float(b_hi[1]));
      ptx::mma_tf32_1688(acc[j], a_hi, __uint_as_float(b_lo[0]), __uint_as_float(b_lo[1]));
      ptx::mma_tf32_1688(acc[j], a_hi, __uint_as_float(b_hi[0]), __uint_as_float(b_hi[1]));
    }
  }
}

// Where a lane's C fragment entries lie in the block's kTileRows rows: acc[j][2 half + e] is row
// row(half), column col(j) + e (RowTiling: with 64 rows, warp w has rows 16 (w / 2) .. +15 and
// the n-tiles of half w % 2).
template <int kTileRows = kRows>
struct FragmentPlace {
  static constexpr int kNTiles = RowTiling<kTileRows>::kNTiles;
  int r0, nt0, g, t4;
  __device__ __forceinline__ FragmentPlace(int warp, int lane)
      : r0(16 * (warp / RowTiling<kTileRows>::kWarpsPerSlab)),
        nt0(kNTiles * (warp % RowTiling<kTileRows>::kWarpsPerSlab)),
        g(lane >> 2),
        t4(lane & 3) {}
  // A 64-row tile's m64n64 wgmma accumulators (multiply_rows_wgmma): warpgroup w / 4 has the
  // columns of half w / 4, warp w % 4 of it rows 16 (w % 4) .. +15; the entries of an m64nN
  // accumulator are those of kNTiles mma C fragments (wgmma.cuh).
  __device__ __forceinline__ static FragmentPlace of_warpgroup(int warp, int lane) {
    static_assert(kTileRows == 64 && kNTiles == 8, "two warpgroups, a 64-column half each");
    FragmentPlace f(0, lane);
    f.r0 = 16 * (warp % 4);
    f.nt0 = kNTiles * (warp / 4);
    return f;
  }
  __device__ __forceinline__ int row(int half) const { return r0 + g + 8 * half; }
  __device__ __forceinline__ int col(int j) const { return 8 * (nt0 + j) + 2 * t4; }
};

// Y = acc + Z on the block's rows in [row_begin, row_end) (row0 is its first), as bf16 or fp32.
// z_at(half, j, row, col): Z's pair at that entry; y_head: the head's offset in Y. keep(r, col,
// y0, y1) sees each pair stored, r within the block (the chain keeps its rows for the next step).
template <int kTileRows, typename ZAt, typename Keep>
__device__ __forceinline__ void store_rows(const float (&acc)[RowTiling<kTileRows>::kNTiles][4], ZAt&& z_at, void* y,
                                           bool y_f32, int64_t row_stride, int64_t y_head, int64_t row0,
                                           int64_t row_begin, int64_t row_end, FragmentPlace<kTileRows> f,
                                           Keep&& keep) {
  constexpr int kNTiles = RowTiling<kTileRows>::kNTiles;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + f.r0 + f.g + 8 * half;  // row0 + f.row(half), 64-bit adds as stitch_kernel was measured
    if (row < row_begin || row >= row_end) continue;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int col = f.col(j);
      const float2 zv = z_at(half, j, row, col);
      const float y0 = acc[j][2 * half] + zv.x, y1 = acc[j][2 * half + 1] + zv.y;
      const int64_t idx = row * row_stride + y_head + col;
      if (y_f32) *reinterpret_cast<float2*>(static_cast<float*>(y) + idx) = make_float2(y0, y1);
      else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(y) + idx) = ptx::pack_bf16x2(y0, y1);
      keep(f.row(half), col, y0, y1);
    }
  }
}

// Z's pairs read where they are stored (the head's rows, row_stride apart).
struct ZFromMemory {
  const float* z;
  int64_t row_stride;
  __device__ __forceinline__ float2 operator()(int, int, int64_t row, int col) const {
    return load2(z + row * row_stride + col);
  }
};
struct KeepNothing {
  __device__ __forceinline__ void operator()(int, int, float, float) const {}
};

// The rows of a segment of sequence 0 (the split pass runs N = 1): [row_begin, row_end).
__device__ __forceinline__ void segment_rows(const StitchParams& p, int segment, int64_t& row_begin, int64_t& row_end) {
  int64_t bos, eos;
  p.seqs.bounds(0, bos, eos);
  StateSplit::segment_tokens(bos, eos, p.segments, segment, p.segment_chunk, row_begin, row_end);
}

template <bool kTransposed, bool kSplitX>
__global__ void __launch_bounds__(kThreads, 2) stitch_kernel(const StitchParams p) {
  constexpr int kMStride = kTransposed ? kPairStride : kWordStride;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<StitchSmem*>(smem_raw);
  float(*m_tile)[kMStride] = reinterpret_cast<float(*)[kMStride]>(&sm.m[0][0]);
  const int h = blockIdx.y, tid = threadIdx.x;
  const int segment = p.segment > 0 ? p.segment + static_cast<int>(blockIdx.z) : 0;
  int64_t row_begin = 0, row_end = p.rows, row0 = int64_t{blockIdx.x} * kRows;
  if (segment > 0) {  // out rows of one segment of sequence 0 (the split pass runs N = 1)
    segment_rows(p, segment, row_begin, row_end);
    row0 += row_begin;
  }
  if (row0 >= row_end) return;  // uniform over the block

  // Loads first, all in flight, then the shared-memory stores: one memory latency a block.
  const float* m = p.m + h * p.m_head_stride + (segment > 0 ? (segment - 1) * p.m_segment_stride : 0);  // [128][128]
  float4 mv[kMVectors], xv[kXVectors<kRows>];
  load_m(m, mv, tid);
  load_x_rows<kRows>(p.x + h * p.head_stride, p.row_stride, row0, row_end, xv, tid);
  store_m(mv, m_tile, tid);
  store_x_rows(xv, sm.x, tid);
  __syncthreads();

  const int warp = tid >> 5, lane = tid & 31;
  float acc[kNTiles][4];
  multiply_rows<kMStride, kTransposed, kSplitX>(sm.x, m_tile, warp, lane, acc);

  store_rows(acc, ZFromMemory{p.z + h * p.head_stride, p.row_stride}, p.y, p.y_f32, p.row_stride, h * p.head_stride,
             row0, row_begin, row_end, FragmentPlace<>(warp, lane), KeepNothing{});
}

// The chain of segment states (StitchChain) in one launch: a block per kChainRows rows of one
// head's S^T. Row r of S_s^T = B_s^T + S_{s-1}^T A_s^T needs only row r of S_{s-1}^T, so a block
// runs every step on its own rows, kept in shared memory in fp32 as the boundary buffer holds
// them (the values one launch a step reads back: the same results bit for bit), and loads the
// next step's A^T into registers while this step's products run. The chain is latency-bound (a
// few heads, S - 1 dependent steps), so its rows go over 8 blocks a head, not 2: each step's
// products a warp are a quarter of 64-row blocks' (8 blocks a head read A^T from the L2 each).
// One launch a step took ~15 us each (ncu at 4036296, P8: 7 steps of 8 blocks); 64-row blocks
// in one launch ~7 us a step (ncu at ba97dbb, P8: 106 us for 15 steps).
constexpr int kChainRows = 16;
using ChainSmem = StitchSmemOf<kChainRows>;
__global__ void __launch_bounds__(kThreads, 1) stitch_chain_kernel(const StitchChain p) {
  constexpr int64_t kStateHead = int64_t{kHeadDim} * kHeadDim;
  constexpr int kNTiles = RowTiling<kChainRows>::kNTiles;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<ChainSmem*>(smem_raw);
  float(*m_tile)[kWordStride] = reinterpret_cast<float(*)[kWordStride]>(&sm.m[0][0]);  // A_s^T as [k][n]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t head = blockIdx.y * kStateHead, row0 = int64_t{blockIdx.x} * kChainRows;
  {
    float4 mv[kMVectors], xv[kXVectors<kChainRows>];
    load_m(p.a_t + head, mv, tid);
    load_x_rows<kChainRows>(p.boundary + head, kHeadDim, row0, kHeadDim, xv, tid);
    store_m(mv, m_tile, tid);
    store_x_rows(xv, sm.x, tid);
  }
  __syncthreads();
  const FragmentPlace<kChainRows> f(warp, lane);
  for (int s = 1; s <= p.steps; ++s) {
    const bool more = s < p.steps;
    float4 next[kMVectors];
    if (more) load_m(p.a_t + s * p.segment_stride + head, next, tid);  // A_{s+1}^T, in flight
    // This step's B_s^T pairs, in flight during the products: loaded after them, their latency
    // held ~45% of the kernel's stall samples (ncu at ef3205e, P8: 166 us for 15 steps).
    const ZFromMemory b{p.b_t + (s - 1) * p.segment_stride + head, kHeadDim};
    float2 zv[2][kNTiles];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) zv[half][j] = b(half, j, row0 + f.row(half), f.col(j));
    float acc[kNTiles][4];
    multiply_rows<kWordStride, false, true>(sm.x, m_tile, warp, lane, acc);
    __syncthreads();  // every warp is done with this step's rows and A^T
    const bool to_final = s == p.segments - 1;
    void* y = to_final ? p.final_state : static_cast<void*>(p.boundary + s * p.segment_stride);
    store_rows(acc, [&](int half, int j, int64_t, int) { return zv[half][j]; }, y,
               to_final ? p.final_f32 : true, kHeadDim, head, row0, 0, kHeadDim, f,
               [&](int r, int col, float y0, float y1) {
                 if (more) *reinterpret_cast<float2*>(&sm.x[r][col]) = make_float2(y0, y1);
               });
    if (more) store_m(next, m_tile, tid);
    __syncthreads();
  }
}

// The out rows of segments 1 .. S-1 (out = out_b + out_a S_{s-1}; StitchParams with segment = 1,
// M = S_{s-1}^T stored transposed) by a grid of at most one block a multiprocessor. The 64-row
// tiles of every (segment, head), `tiles_per_group` of them each (an upper bound: the segment's
// own rows decide), are dealt in order, an even share a block; a block keeps the M of its
// current (segment, head) in shared memory and loads it again only where its share crosses into
// the next. Each tile's X and Z come by the copy engine (tensor-map boxes, p.x_rows, p.z_rows)
// into one of two stages, the next tile's issued by thread 0 as this one's products start, so
// that the loads never wait behind the products (the register-staged form ran at 1.6 TB/s at P8:
// 193 us, ncu at 443eb06). stitch_kernel's one-tile blocks load M (64 KB) for every 32 KB of X and
// wait on each load. The same products and sums, tile for tile: bit for bit stitch_kernel's
// results. kWgmma (the default, StitchParams::rows_wgmma): the products on wgmma instead,
// multiply_rows_wgmma; not bit for bit (other rounding, other order of the sums).
template <bool kWgmma>
struct RowsSmemOf {
  // S_{s-1}^T as M^T [n][k]: padded rows (mma.sync) or wgmma's B tile (m_canonical_offset)
  std::conditional_t<kWgmma, float[kHeadDim * kHeadDim], float[kHeadDim][kPairStride]> m;
  float x[2][kRows][kStitchRowStride];  // the stages: X rows (8 zero columns past each row)
  float z[2][kRows][kStitchRowStride];  // Z rows
};

// The rows kernel's products on wgmma (m64n64k8 tf32, A from registers): M^T rounded to tf32 as
// the B operand, K-major without swizzle (wgmma.cuh): k-step kk's 8 columns of the 128 n rows are
// 16 groups of 8 rows, each two core matrices of 8 rows x 16 bytes (k-slots 0..3 and 4..7),
// the groups 128 bytes apart, the slot halves 2 KB apart, the k-steps 4 KB apart. The k-slots are
// permuted as multiply_rows loads its A pairs (slot t = column 2t, slot t + 4 = column 2t + 1 of
// the k-step), so that a lane's A entries stay one 8-byte load. X is split hi + lo in registers
// (2 wgmmas a k-step against mma.sync's 2xTF32 form, which rounds X and splits M: the same one
// rounding, ~2^-12 relative, on the other operand). Measured at P8 (ncu, ba97dbb): the mma.sync
// form's samples sat on its HMMAs (2048 a 64-row tile) at 5.5 us a tile.
constexpr uint32_t kCanonGroupBytes = 128;                                   // 8 n rows x 4 k-slots
constexpr uint32_t kCanonHalfBytes = kHeadDim / 8 * kCanonGroupBytes;        // k-slots 4..7 after 0..3
constexpr uint32_t kCanonStepBytes = 2 * kCanonHalfBytes;                     // one k-step of 8 columns
static_assert(kCanonStepBytes * (kHeadDim / 8) == sizeof(float) * kHeadDim * kHeadDim, "the tile is M, no padding");
__device__ __forceinline__ uint32_t m_canonical_offset(int n, int kk) {
  return kk * kCanonStepBytes + (n / 8) * kCanonGroupBytes + (n % 8) * 16;
}
// Thread tid's (n row, k-step) pairs of M^T: pair tid + v kThreads, consecutive lanes on consecutive
// n (the 8 lanes of a 16-byte store phase fill one 128-byte group: no bank conflict).
constexpr int kMPairs = kHeadDim * (kHeadDim / 8) / kThreads;
__device__ __forceinline__ void load_m_pairs(const float* m, float4 (&mv)[2 * kMPairs], int tid) {
#pragma unroll
  for (int v = 0; v < kMPairs; ++v) {
    const int i = tid + v * kThreads, n = i % kHeadDim, kk = i / kHeadDim;
    mv[2 * v] = *reinterpret_cast<const float4*>(m + n * kHeadDim + 8 * kk);
    mv[2 * v + 1] = *reinterpret_cast<const float4*>(m + n * kHeadDim + 8 * kk + 4);
  }
}
__device__ __forceinline__ void store_m_canonical(const float4 (&mv)[2 * kMPairs], float* tile, int tid) {
  uint8_t* base = reinterpret_cast<uint8_t*>(tile);
#pragma unroll
  for (int v = 0; v < kMPairs; ++v) {
    const int i = tid + v * kThreads;
    const float4 a = mv[2 * v], b = mv[2 * v + 1];  // columns 8 kk + 0..3, + 4..7
    uint8_t* at = base + m_canonical_offset(i % kHeadDim, i / kHeadDim);
    *reinterpret_cast<float4*>(at) = make_float4(ptx::tf32_operand(a.x), ptx::tf32_operand(a.z),
                                                 ptx::tf32_operand(b.x), ptx::tf32_operand(b.z));
    *reinterpret_cast<float4*>(at + kCanonHalfBytes) = make_float4(ptx::tf32_operand(a.y), ptx::tf32_operand(a.w),
                                                                   ptx::tf32_operand(b.y), ptx::tf32_operand(b.w));
  }
}
// acc = X M^T's product for the tile's 64 rows, warpgroup w / 4 on columns 64 (w / 4) .. +63
// (FragmentPlace::of_warpgroup); m_desc: that half's B descriptor at k-step 0.
__device__ __forceinline__ void multiply_rows_wgmma(const float (&x)[kRows][kPairStride], uint64_t m_desc, int warp,
                                                    int lane, float (&acc)[4 * kNTiles]) {
  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * (warp % 4);
  constexpr int kSteps = kHeadDim / 8;
  uint32_t hi[kSteps][4], lo[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const float2 top = load2(&x[r0 + g][8 * kk + 2 * t4]);
    const float2 bottom = load2(&x[r0 + g + 8][8 * kk + 2 * t4]);
    split_tf32(top.x, hi[kk][0], lo[kk][0]);
    split_tf32(bottom.x, hi[kk][1], lo[kk][1]);
    split_tf32(top.y, hi[kk][2], lo[kk][2]);
    split_tf32(bottom.y, hi[kk][3], lo[kk][3]);
  }
#pragma unroll
  for (int i = 0; i < 4 * kNTiles; ++i) acc[i] = 0.0f;
  ptx::fence_operands(acc);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const uint64_t b = ptx::smem_matrix_desc_advance(m_desc, kk * kCanonStepBytes);
    ptx::wgmma_tf32<64>(acc, lo[kk], b, true);
    ptx::wgmma_tf32<64>(acc, hi[kk], b, true);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::fence_operands(acc);
}
static_assert(kStitchRowTile == kRows && kStitchRowStride == kPairStride,
              "X tiles in the rows stages are read as multiply_rows reads them");
static_assert(sizeof(float) * kRows * kStitchRowStride % 128 == 0, "stages stay 128-byte aligned");
constexpr uint32_t kRowsBoxBytes = sizeof(float) * kRows * kStitchRowStride;  // one tensor-map box

template <bool kSplitX, bool kWgmma>
__global__ void __launch_bounds__(kThreads, 1) stitch_rows_kernel(const __grid_constant__ StitchParams p, int H,
                                                                  int64_t tiles_per_group) {
  static_assert(!(kSplitX && kWgmma), "the wgmma form splits X and rounds M (2xTF32)");
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<RowsSmemOf<kWgmma>*>(smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127));
  __shared__ uint64_t full[2];  // a stage's X and Z boxes landed
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t total = int64_t{p.segments - 1} * H * tiles_per_group;
  const int64_t begin = total * blockIdx.x / gridDim.x, count = total * (blockIdx.x + 1) / gridDim.x - begin;
  const FragmentPlace<> f = kWgmma ? FragmentPlace<>::of_warpgroup(warp, lane) : FragmentPlace<>(warp, lane);
  // wgmma: this warpgroup's half of M's columns (n rows of the B tile), k-step 0
  const uint8_t* m_half =
      reinterpret_cast<const uint8_t*>(&sm.m[0]) + (warp / 4) * (kHeadDim / 2 / 8) * kCanonGroupBytes;
  const uint64_t m_desc = kWgmma ? ptx::smem_matrix_desc(m_half, kCanonHalfBytes, kCanonGroupBytes) : 0;
  // Tile i of the deal: group i / tiles_per_group = (segment - 1) H + head, tile i % tiles_per_group.
  struct Tile {
    int64_t group, row0, row_begin, row_end;
  };
  auto tile_at = [&](int64_t i) {
    Tile t;
    t.group = i / tiles_per_group;
    segment_rows(p, 1 + static_cast<int>(t.group / H), t.row_begin, t.row_end);
    t.row0 = t.row_begin + (i % tiles_per_group) * kRows;
    return t;
  };
  // Thread 0: the k-th tile's X and Z rows into stage k % 2 (a tile past its segment's rows too,
  // so that every tile has its phase; rows past the tensor arrive as zeros).
  auto issue = [&](int64_t k) {
    const Tile u = tile_at(begin + k);
    const int stage = static_cast<int>(k & 1);
    const int h = static_cast<int>(u.group % H), row0 = static_cast<int>(u.row0);  // < 2^31 tokens (the plan)
    ptx::mbarrier_arrive_expect_tx(&full[stage], 2 * kRowsBoxBytes);
    ptx::tensor_copy_3d_g2s(&sm.x[stage][0][0], &p.x_rows, 0, h, row0, &full[stage]);
    ptx::tensor_copy_3d_g2s(&sm.z[stage][0][0], &p.z_rows, 0, h, row0, &full[stage]);
  };
  if (tid == 0) {
    ptx::mbarrier_init(&full[0], 1);
    ptx::mbarrier_init(&full[1], 1);
    ptx::fence_mbarrier_init();
    if (count > 0) issue(0);
  }
  __syncthreads();
  int64_t loaded_group = -1;
  for (int64_t k = 0; k < count; ++k) {
    // Stage (k + 1) % 2 was read by tile k - 1, done at its trailing barrier.
    if (tid == 0 && k + 1 < count) issue(k + 1);
    const Tile t = tile_at(begin + k);
    const int h = static_cast<int>(t.group % H), segment = 1 + static_cast<int>(t.group / H);
    if (t.row0 < t.row_end && t.group != loaded_group) {  // this (segment, head)'s M (no thread reads M now)
      const float* m = p.m + h * p.m_head_stride + (segment - 1) * p.m_segment_stride;
      if constexpr (kWgmma) {
        float4 mv[2 * kMPairs];
        load_m_pairs(m, mv, tid);
        store_m_canonical(mv, sm.m, tid);
        ptx::fence_proxy_async_shared();  // the generic stores, before wgmma reads the tile
      } else {
        float4 mv[kMVectors];
        load_m(m, mv, tid);
        store_m(mv, sm.m, tid);
      }
      loaded_group = t.group;
      __syncthreads();
    }
    const int stage = static_cast<int>(k & 1);
    ptx::mbarrier_wait_parity(&full[stage], static_cast<uint32_t>(k >> 1) & 1u);
    if (t.row0 < t.row_end) {  // uniform over the block
      float acc[kNTiles][4];
      if constexpr (kWgmma)
        multiply_rows_wgmma(sm.x[stage], m_desc, warp, lane, reinterpret_cast<float(&)[4 * kNTiles]>(acc));
      else
        multiply_rows<kPairStride, true, kSplitX>(sm.x[stage], sm.m, warp, lane, acc);
      const auto& z = sm.z[stage];
      store_rows(acc, [&](int half, int, int64_t, int col) { return load2(&z[f.row(half)][col]); }, p.y, p.y_f32,
                 p.row_stride, h * p.head_stride, t.row0, t.row_begin, t.row_end, f, KeepNothing{});
    }
    __syncthreads();  // every warp is done with this stage (and M) before they are written again
  }
}

template <bool kTransposed, bool kSplitX>
void launch_stitch_form(const StitchParams& p, int heads, cudaStream_t stream, int segment_launches) {
  constexpr int kSmem = sizeof(StitchSmem);
  static_assert(2 * kSmem <= 227 * 1024, "two blocks a multiprocessor");
  static PerDeviceOnce raised;
  raised.run("stitch kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(stitch_kernel<kTransposed, kSplitX>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const dim3 grid(static_cast<unsigned>((p.rows + kRows - 1) / kRows), static_cast<unsigned>(heads),
                  static_cast<unsigned>(segment_launches));
  launch_kernel(stitch_kernel<kTransposed, kSplitX>, grid, dim3(kThreads), kSmem, stream, false, "stitch kernel", p);
}

template <bool kSplitX, bool kWgmma>
void launch_stitch_rows_form(const StitchParams& p, int heads, int64_t blocks, int64_t tiles_per_group,
                             cudaStream_t stream) {
  constexpr int kSmem = sizeof(RowsSmemOf<kWgmma>) + 128;  // + the alignment the stages' tensor-map copies need
  static_assert(kSmem <= 227 * 1024, "M and two stages in one block's shared memory");
  const auto kernel = stitch_rows_kernel<kSplitX, kWgmma>;
  static PerDeviceOnce raised;
  raised.run("stitch rows kernel: setting its shared memory size", [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), kSmem, stream, false,
                "stitch rows kernel", p, heads, tiles_per_group);
}

}  // namespace

void launch_stitch_chain(const StitchChain& p, int heads, cudaStream_t stream) {
  constexpr int kSmem = sizeof(ChainSmem);
  if (p.steps < 1 || p.steps > p.segments - 1) fail(ErrorCode::kInternal, "stitch chain: ", p.steps, " steps");
  static PerDeviceOnce raised;
  raised.run("stitch chain kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(stitch_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  launch_kernel(stitch_chain_kernel, dim3(kHeadDim / kChainRows, static_cast<unsigned>(heads)), dim3(kThreads), kSmem,
                stream, false, "stitch chain kernel", p);
}

void launch_stitch_rows(const StitchParams& p, int heads, int sms, cudaStream_t stream) {
  if (p.segment != 1 || !p.m_transposed || p.segments < 2 || sms < 1)
    fail(ErrorCode::kInternal, "stitch rows: segment ", p.segment, " of ", p.segments);
  const int64_t tiles_per_group = (p.rows + kRows - 1) / kRows;
  const int64_t tiles = int64_t{p.segments - 1} * heads * tiles_per_group;
  const int64_t blocks = tiles < sms ? tiles : sms;  // one a multiprocessor (its shared memory)
  if (blocks == 0) return;
  if (p.x_split) launch_stitch_rows_form<true, false>(p, heads, blocks, tiles_per_group, stream);
  else if (p.rows_wgmma) launch_stitch_rows_form<false, true>(p, heads, blocks, tiles_per_group, stream);
  else launch_stitch_rows_form<false, false>(p, heads, blocks, tiles_per_group, stream);
}

void launch_stitch(const StitchParams& p, int heads, cudaStream_t stream, int segment_launches) {
  if (!p.m_transposed && !p.x_split) fail(ErrorCode::kInternal, "stitch: the chain of states keeps 3xTF32");
  if (!p.m_transposed) launch_stitch_form<false, true>(p, heads, stream, segment_launches);
  else if (p.x_split) launch_stitch_form<true, true>(p, heads, stream, segment_launches);
  else launch_stitch_form<true, false>(p, heads, stream, segment_launches);
}

}  // namespace flashkda::gpu
