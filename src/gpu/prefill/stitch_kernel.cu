// Stitch kernel: combines the runs of the split state pass (state_kernel.cu, kSplit), which are
// linear in the state S_{s-1} where segment s starts:
//   S_s^T  = B_s^T + S_{s-1}^T A_s^T                                     (Y = Z + X M)
//   out[t] = out_b[t] + out_a[t] S_{s-1}   for the rows t of segment s   (Y = Z + X M^T, M = S_{s-1}^T)
#include <cuda_runtime.h>

#include "api/validate.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/mma.cuh"

namespace flashkda::gpu {
namespace {

// One block: 128 rows of one head (8 warps x 16 rows) against a 128 x 128 M, on the tensor cores
// in 3xTF32 (X M = Xhi Mhi + Xhi Mlo + Xlo Mhi, each product m16n8k8 tf32 with fp32
// accumulators: about fp32's accuracy, where plain tf32 would add ~5e-4 to out when the state is
// large). The FMA version took 30 us a chain step and 430 us for P8's out rows (ncu, 189cc93).
constexpr int kWarps = 8;
constexpr int kRows = kWarps * 16;
constexpr int kThreads = kWarps * 32;
// fp32 rows padded by 8 floats: row r starts in bank 8r, so the 8-byte fragment loads of rows
// g = 0..3 (one half-warp) never collide.
constexpr int kStride = kHeadDim + 8;

struct StitchSmem {
  float x[kRows][kStride];        // X rows
  float m_hi[kHeadDim][kStride];  // M^T [n][k], tf32 high part (B fragments are then one load)
  float m_lo[kHeadDim][kStride];  // M^T - m_hi
};

__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

__global__ void __launch_bounds__(kThreads) stitch_kernel(const StitchParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<StitchSmem*>(smem_raw);
  const int h = blockIdx.y, tid = threadIdx.x;
  const int segment = p.segment > 0 ? p.segment + static_cast<int>(blockIdx.z) : 0;
  int64_t row_begin = 0, row_end = p.rows, row0 = int64_t{blockIdx.x} * kRows;
  if (segment > 0) {  // out rows of one segment of sequence 0 (the split pass runs N = 1)
    int64_t bos, eos;
    p.seqs.bounds(0, bos, eos);
    int c_begin, c_end;
    StateSplit::segment_chunks(static_cast<int>((eos - bos + kChunk - 1) / kChunk), p.segments, segment, c_begin,
                               c_end);
    row_begin = bos + int64_t{c_begin} * kChunk;
    row_end = min(bos + int64_t{c_end} * kChunk, eos);
    row0 += row_begin;
  }
  if (row0 >= row_end) return;  // uniform over the block

  // M^T into shared memory, split hi + lo: m_hi[n][k] = M[k][n] (Y = X M), or M[n][k] as stored
  // (Y = X M^T). All 16 loads of a thread are issued before the first store: one device-memory
  // latency per block, not one per load (the FMA version's loop waited on each: ~30 us a block).
  const float* m = p.m + h * p.m_head_stride + (segment > 0 ? (segment - 1) * p.m_segment_stride : 0);  // [128][128]
  constexpr int kVectors = kHeadDim * kHeadDim / 4 / kThreads;  // float4 loads a thread, for M and for X
  float4 mv[kVectors];
#pragma unroll
  for (int v = 0; v < kVectors; ++v) mv[v] = reinterpret_cast<const float4*>(m)[tid + v * kThreads];
  const float* x = p.x + h * p.head_stride;
  float4 xv[kVectors];
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const int i = tid + v * kThreads, r = i / (kHeadDim / 4), q = i % (kHeadDim / 4);
    const int64_t row = row0 + r;
    xv[v] = row < row_end ? *reinterpret_cast<const float4*>(x + row * p.row_stride + 4 * q)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int v = 0; v < kVectors; ++v) {
    const int i = tid + v * kThreads, r = i / (kHeadDim / 4), c = 4 * (i % (kHeadDim / 4));
    const float e[4] = {mv[v].x, mv[v].y, mv[v].z, mv[v].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float hi = ptx::tf32_high_part(e[j]);
      const int n = p.m_transposed ? r : c + j, k = p.m_transposed ? c + j : r;
      sm.m_hi[n][k] = hi;
      sm.m_lo[n][k] = e[j] - hi;  // a NaN that the high part dropped stays here
    }
    *reinterpret_cast<float4*>(&sm.x[r][c]) = xv[v];
  }
  static_assert(kRows * kHeadDim == kHeadDim * kHeadDim, "X and M tiles share the load loop");
  __syncthreads();

  // Warp w: rows 16 w .. 16 w + 15, all 16 n-tiles; k-slot t = element 2t, t + 4 = 2t + 1 (mma.cuh).
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  float acc[kHeadDim / 8][4] = {};
#pragma unroll 2
  for (int k0 = 0; k0 < kHeadDim; k0 += 8) {
    const float2 top = load2(&sm.x[16 * warp + g][k0 + 2 * t4]);
    const float2 bottom = load2(&sm.x[16 * warp + g + 8][k0 + 2 * t4]);
    const float a[4] = {top.x, bottom.x, top.y, bottom.y};
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float hi = ptx::tf32_high_part(a[i]);
      a_hi[i] = __float_as_uint(hi);
      a_lo[i] = __float_as_uint(a[i] - hi);
    }
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      const float2 b_hi = load2(&sm.m_hi[8 * nt + g][k0 + 2 * t4]);
      const float2 b_lo = load2(&sm.m_lo[8 * nt + g][k0 + 2 * t4]);
      ptx::mma_tf32_1688(acc[nt], a_lo, b_hi.x, b_hi.y);
      ptx::mma_tf32_1688(acc[nt], a_hi, b_lo.x, b_lo.y);
      ptx::mma_tf32_1688(acc[nt], a_hi, b_hi.x, b_hi.y);
    }
  }

  // C fragments: acc[nt][0..1] row g, columns 8 nt + 2 t4 (+1); acc[nt][2..3] row g + 8.
  const float* z = p.z + h * p.head_stride;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + 16 * warp + g + 8 * half;
    if (row < row_begin || row >= row_end) continue;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      const int col = 8 * nt + 2 * t4;
      const float2 zv = load2(z + row * p.row_stride + col);
      const float y0 = acc[nt][2 * half] + zv.x, y1 = acc[nt][2 * half + 1] + zv.y;
      const int64_t idx = row * p.row_stride + h * p.head_stride + col;
      if (p.y_f32) *reinterpret_cast<float2*>(static_cast<float*>(p.y) + idx) = make_float2(y0, y1);
      else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.y) + idx) = ptx::pack_bf16x2(y0, y1);
    }
  }
}

}  // namespace

void launch_stitch(const StitchParams& p, int heads, cudaStream_t stream, int segment_launches) {
  static_assert(sizeof(StitchSmem) <= 227 * 1024, "shared memory");
  constexpr int kSmem = sizeof(StitchSmem);
  static PerDeviceOnce raised;
  raised.run("stitch kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(stitch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const dim3 grid(static_cast<unsigned>((p.rows + kRows - 1) / kRows), static_cast<unsigned>(heads),
                  static_cast<unsigned>(segment_launches));
  stitch_kernel<<<grid, kThreads, kSmem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "stitch kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
