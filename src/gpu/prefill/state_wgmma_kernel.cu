// The state pass on wgmma (experimental; FLASHKDA_STATE_WGMMA=1 forces it, nothing chooses it
// yet): the chunk step of state_kernel.cu with every B operand read from shared memory once a
// warpgroup instead of once a warp. ncu showed the 8x1 mma.sync pass bound by shared-memory
// bandwidth (95% busy at P1: each of its 8 warps reads the whole record every chunk).
//
// One block of 256 threads per (sequence, head): two warpgroups of 64 value rows each (warp w of
// warpgroup wg holds rows 64 wg + 16 w .. + 15 of S^T [128 v][128 k] as an m64n128 accumulator,
// the same fragments as one 8x1 warp's, so state loads, stores and out stores are
// state_step.cuh's). Thread 0 also keeps kStages chunks (WgmmaRecord + the v rows) in flight: it
// refills a stage once every thread has released it. No producer warp: a ninth warp caps every
// thread at 168 registers (3 warps on a quarter of the register file) and the step needs ~180;
// a producer warpgroup with setmaxnreg still compiled the step at 168 (ptxas C7512). Per
// chunk, with the record of chunk_record.cuh (WgmmaRecord):
//   group 1: X^T = S^T Wk^T (m64n16k8 x 16), WV^T = V^T (W_hi + W_lo)^T (x 4)
//   group 2: O^T = S^T Qe^T (x 16), issued while group 1 runs
//   U^T = tf32(WV^T - X^T); S^T *= Diag(exp(G_C)) once group 2 has read S^T
//   group 3: O^T += WV^T M^T (x 2), S^T += U^T Kr (m64n128k8 x 2)
// ptxas needs the A operand taken from WV^T's accumulator copied (one add, see wgmma.cuh) and
// each accumulator's products in a group of their own; tests/gpu/test_wgmma_step_gpu.cu is the
// same step on a fixed chunk. Not taken by the plan: per-item only (no split or persistent
// pass), V-major states, no checkpoints.
#include <cuda_runtime.h>

#include "api/validate.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/state_step.cuh"
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::gpu {
namespace {

using namespace state_pass;

constexpr int kStages = 6;
constexpr uint32_t kVBytes = kChunk * kHeadDim * 2;                   // the chunk's v rows, bf16
constexpr uint32_t kWgmmaStageBytes = WgmmaRecord::kBytes + kVBytes;  // 31.5 KB
constexpr int kConsumers = 256;                                       // two warpgroups
constexpr int kThreads = kConsumers;
constexpr int kSmem = 128 + kStages * kWgmmaStageBytes;
static_assert(kWgmmaStageBytes % 128 == 0 && kSmem <= kMaxBlockSmem, "stages aligned, and within a block's memory");

__device__ __forceinline__ void fill_wgmma_stage(uint8_t* stage, uint64_t* full, const uint8_t* record,
                                                 const CUtensorMap* v_rows, int h, int64_t token0) {
  ptx::mbarrier_arrive_expect_tx(full, kWgmmaStageBytes);
  ptx::bulk_copy_g2s(stage, record, WgmmaRecord::kBytes, full);
  ptx::tensor_copy_3d_g2s(stage + WgmmaRecord::kBytes, v_rows, 0, h, static_cast<int>(token0), full);
}

__device__ __forceinline__ uint64_t tile_desc(const uint8_t* tile) { return ptx::smem_matrix_desc(tile, 128, 256); }

// A fragment for k-step j of an m64nN accumulator (k permuted: mma.cuh, tf32_a_from_c).
template <int R>
__device__ __forceinline__ void a_from_d(const float (&d)[R], int j, uint32_t (&a)[4]) {
  a[0] = __float_as_uint(d[4 * j]);
  a[1] = __float_as_uint(d[4 * j + 2]);
  a[2] = __float_as_uint(d[4 * j + 1]);
  a[3] = __float_as_uint(d[4 * j + 3]);
}

// One chunk on this warpgroup's 64 value rows. s: S^T as the m64n128 accumulator (s[4 j + i] =
// acc[j][i] of state_step.cuh); rec: the stage; out_chunk: the chunk's first out row of the head.
__device__ __forceinline__ void wgmma_chunk_step(float (&s)[64], const uint8_t* rec, int vbase, int lane,
                                                 uint16_t* out_chunk, int count, int64_t out_row_stride) {
  const int g = lane >> 2, t4 = lane & 3;
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(rec + WgmmaRecord::kBytes);  // [16][128]
  float x[8] = {}, o[8] = {}, wv[8] = {};
  uint32_t as[16][4], av[2][4];  // S^T's A fragments by k-step; V^T's: (v row, token 8 st + t4 (+4))
#pragma unroll
  for (int st = 0; st < 16; ++st) a_from_d(s, st, as[st]);
#pragma unroll
  for (int st = 0; st < 2; ++st)
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // tokens past the sequence end read as 0 (the tile may hold the next one's)
      const int tok = 8 * st + t4 + 4 * half;
      const bool live = tok < count;
      av[st][2 * half] = live ? uint32_t{v_rows[tok * kHeadDim + vbase + g]} << 16 : 0u;
      av[st][2 * half + 1] = live ? uint32_t{v_rows[tok * kHeadDim + vbase + g + 8]} << 16 : 0u;
    }
  // (S^T's A fragments are left unpinned: pinned, ptxas serializes the wgmmas here, C7511.)
  ptx::fence_operands(av[0]);
  ptx::fence_operands(av[1]);
  ptx::fence_operands(x);
  ptx::fence_operands(wv);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < 16; ++st) ptx::wgmma_tf32<16>(x, as[st], tile_desc(rec + WgmmaRecord::kWk + 512 * st), st > 0);
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    ptx::wgmma_tf32<16>(wv, av[st], tile_desc(rec + WgmmaRecord::kW + 512 * st), st > 0);
    ptx::wgmma_tf32<16>(wv, av[st], tile_desc(rec + WgmmaRecord::kW + 1024 + 512 * st), true);
  }
  ptx::wgmma_commit();
  ptx::fence_operands(o);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < 16; ++st) ptx::wgmma_tf32<16>(o, as[st], tile_desc(rec + WgmmaRecord::kQe + 512 * st), st > 0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<1>();  // X and WV done; O may still read S^T
  ptx::fence_operands(x);
  ptx::fence_operands(wv);

  float u[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) u[i] = ptx::tf32_operand(wv[i] - x[i]);  // U^T, rounded as the 8x1 step's
  uint32_t aw[2][4], au[2][4];
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    a_from_d(wv, st, aw[st]);
    a_from_d(u, st, au[st]);
#pragma unroll
    for (int e = 0; e < 4; ++e) aw[st][e] += 0x1000u;  // registers of their own (wgmma.cuh)
    ptx::fence_operands(aw[st]);
    ptx::fence_operands(au[st]);
  }
  ptx::wgmma_wait<0>();  // O's products have read S^T
  ptx::fence_operands(s);
  ptx::fence_operands(o);
  const float* decay = reinterpret_cast<const float*>(rec + WgmmaRecord::kDecay);
#pragma unroll
  for (int j = 0; j < 16; ++j) {  // S^T Diag(exp(G_C)): columns 8 j + 2 t4 (+1)
    const float2 d = *reinterpret_cast<const float2*>(decay + 8 * j + 2 * t4);
    s[4 * j] *= d.x, s[4 * j + 1] *= d.y, s[4 * j + 2] *= d.x, s[4 * j + 3] *= d.y;
  }
  ptx::fence_operands(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < 2; ++st) ptx::wgmma_tf32<16>(o, aw[st], tile_desc(rec + WgmmaRecord::kM + 512 * st), true);
#pragma unroll
  for (int st = 0; st < 2; ++st) ptx::wgmma_tf32<128>(s, au[st], tile_desc(rec + WgmmaRecord::kKr + 4096 * st), true);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::fence_operands(s);
  ptx::fence_operands(o);

  // O^T fragments (rows v, columns tokens) transposed in registers to (token, v pair) and stored,
  // as state_step.cuh does.
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t ov = ptx::movmatrix_trans(ptx::pack_bf16x2(o[4 * nt + 2 * r], o[4 * nt + 2 * r + 1]));
      const int token = nt * 8 + g;
      if (token < count) *reinterpret_cast<uint32_t*>(out_chunk + token * out_row_stride + vbase + 8 * r + 2 * t4) = ov;
    }
}

__global__ void __launch_bounds__(kThreads, 1) state_wgmma_kernel(const __grid_constant__ StateParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = p.num_heads;
  const int64_t n = blockIdx.x / H;
  const int h = static_cast<int>(blockIdx.x % H);
  const int64_t start = p.slots.start(n);
  if (!p.slots.runs(start, p.initial_state != nullptr)) return;  // padding: nothing is written for it
  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);
  const int num_chunks = static_cast<int>((eos - bos + kChunk - 1) / kChunk);  // < 2^31 tokens
  const int64_t record_stride = static_cast<int64_t>(H) * WgmmaRecord::kBytes;
  const uint8_t* records =
      p.records + p.seqs.first_slot(n, bos) * record_stride + static_cast<int64_t>(h) * WgmmaRecord::kBytes;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);  // tensor-map destinations
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kConsumers);  // every consumer thread releases the stage
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  auto fill = [&](int c) {  // thread 0: chunk c into its stage
    fill_wgmma_stage(smem + (c % kStages) * kWgmmaStageBytes, &full[c % kStages], records + int64_t{c} * record_stride,
                     &p.v_rows, h, bos + int64_t{c} * kChunk);
  };
  if (threadIdx.x == 0)
    for (int c = 0; c < num_chunks && c < kStages; ++c) fill(c);

  const int vbase = 64 * (warp / 4) + 16 * (warp % 4);
  float acc[kNTiles][4];
  load_state(acc, p.initial_state, p.initial_state_f32, (start * H + h) * static_cast<int64_t>(kHeadDim) + vbase, 0,
             lane);
  float(&s_acc)[64] = reinterpret_cast<float(&)[64]>(acc);
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  uint16_t* out_head = p.out + bos * out_row_stride + h * kHeadDim;
  int s = 0;
  uint32_t parity = 0;
  for (int c = 0; c < num_chunks; ++c) {
    ptx::mbarrier_wait_parity(&full[s], parity);
    const int64_t left = eos - bos - int64_t{c} * kChunk;
    wgmma_chunk_step(s_acc, smem + s * kWgmmaStageBytes, vbase, lane, out_head + int64_t{c} * kChunk * out_row_stride,
                     static_cast<int>(left < kChunk ? left : kChunk), out_row_stride);
    ptx::mbarrier_arrive(&empty[s]);  // this thread's reads of the stage are done
    if (threadIdx.x == 0 && c + kStages < num_chunks) {  // every thread has left the stage: refill it
      ptx::mbarrier_wait_parity(&empty[s], parity);
      fill(c + kStages);
    }
    if (++s == kStages) {
      s = 0;
      parity ^= 1;
    }
  }
  if (const int64_t f = p.slots.final_slot(n, start); p.final_state && f >= 0)
    store_state(acc, p.final_state, p.final_state_f32, (f * H + h) * static_cast<int64_t>(kHeadDim) + vbase, 0, lane);
}

}  // namespace

void launch_state_wgmma(const StateParams& p, cudaStream_t stream) {
  if (p.split.segments > 0 || p.checkpoints.count > 0 || p.k_major || p.item_counter)
    fail(ErrorCode::kInternal, "wgmma state kernel: per-item, V-major, no checkpoints only");
  static PerDeviceOnce raised;  // the shared-memory limit, raised once per device the caller uses
  raised.run("wgmma state kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(state_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const int64_t blocks = p.seqs.num_seqs * p.num_heads;
  if (blocks == 0) return;
  state_wgmma_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "wgmma state kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
