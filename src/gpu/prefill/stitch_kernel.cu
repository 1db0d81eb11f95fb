// Stitch kernel: combines the runs of the split state pass (state_kernel.cu, kSplit), which are
// linear in the state S_{s-1} where segment s starts:
//   S_s^T  = B_s^T + S_{s-1}^T A_s^T                                     (Y = Z + X M)
//   out[t] = out_b[t] + out_a[t] S_{s-1}   for the rows t of segment s   (Y = Z + X M^T, M = S_{s-1}^T)
// One block: 64 rows of one head against a 128 x 128 M held in shared memory, fp32 FMAs.
#include <cuda_runtime.h>

#include "api/validate.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/convert.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kRows = 64;       // rows per block
constexpr int kThreads = 256;   // 64 column pairs x 4 groups of 16 rows
// Rows padded by 4 floats: the transposing fills hit 8 banks a warp instead of one.
constexpr int kMStride = kHeadDim + 4;
constexpr int kXStride = kRows + 4;

struct StitchSmem {
  float m[kHeadDim][kMStride];  // M[j][c]
  float x[kHeadDim][kXStride];  // X^T: x[j][row], read as broadcast float4
};

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

  const float* m = p.m + h * p.m_head_stride + (segment > 1 ? (segment - 1) * p.m_segment_stride : 0);  // [128][128]
  for (int i = tid; i < kHeadDim * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    if (p.m_transposed) sm.m[c][r] = m[i];
    else sm.m[r][c] = m[i];
  }
  const float* x = p.x + h * p.head_stride;
  for (int i = tid; i < kRows * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, j = i % kHeadDim;
    const int64_t row = row0 + r;
    sm.x[j][r] = row >= row_begin && row < row_end ? x[row * p.row_stride + j] : 0.0f;
  }
  __syncthreads();

  const int cp = tid % 64, rg = tid / 64;  // columns 2cp, 2cp + 1; rows 16 rg .. 16 rg + 15
  float acc[16][2] = {};
#pragma unroll 4
  for (int j = 0; j < kHeadDim; ++j) {
    const float2 mv = *reinterpret_cast<const float2*>(&sm.m[j][2 * cp]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 xv = *reinterpret_cast<const float4*>(&sm.x[j][16 * rg + 4 * q]);
      const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[4 * q + e][0] = fmaf(xs[e], mv.x, acc[4 * q + e][0]);
        acc[4 * q + e][1] = fmaf(xs[e], mv.y, acc[4 * q + e][1]);
      }
    }
  }
  const float* z = p.z + h * p.head_stride;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int64_t row = row0 + 16 * rg + r;
    if (row < row_begin || row >= row_end) continue;
    const int64_t idx = row * p.row_stride + h * p.head_stride + 2 * cp;
    const float2 zv = *reinterpret_cast<const float2*>(z + row * p.row_stride + 2 * cp);
    const float y0 = acc[r][0] + zv.x, y1 = acc[r][1] + zv.y;
    if (p.y_f32) *reinterpret_cast<float2*>(static_cast<float*>(p.y) + idx) = make_float2(y0, y1);
    else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.y) + idx) = ptx::pack_bf16x2(y0, y1);
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
