// State pass on the narrow layout (state_step_narrow.cuh): a block holds VW warps of 8 value
// columns of one (sequence, head), kGroups = 16 / VW blocks a head, plus one producer warp that
// streams the chunk records (F16Records) and v rows through the stage ring, as the per-item
// kernel (state_kernel.cu) does. The plain pass only: V-major states, no checkpoints, no split,
// no prep tail (the launcher keeps those on the other passes).
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/state_step_narrow.cuh"
#include "gpu/ptx/grid_sync.cuh"

namespace flashkda::gpu {
namespace {

using namespace state_pass;

// BLOCKS: the blocks a multiprocessor the layout is meant to run (its stages: stages_fitting).
template <int VW, int BLOCKS>
__global__ void __launch_bounds__((VW + 1) * 32, 1) state_narrow_kernel(const __grid_constant__ StateParams p) {
  constexpr int kStages = stages_fitting(BLOCKS, 0);
  constexpr int kGroups = kHeadDim / (kNarrowWidth * VW);  // blocks per head
  static_assert(kGroups * kNarrowWidth * VW == kHeadDim, "whole heads");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = p.num_heads;
  const int64_t head_block = blockIdx.x / kGroups;
  const int h = static_cast<int>(head_block % H);
  const int64_t n = head_block / H;
  const int vbase = (static_cast<int>(blockIdx.x % kGroups) * VW + warp) * kNarrowWidth;

  const int64_t start = p.slots.start(n);
  if (!p.slots.runs(start, p.initial_state != nullptr)) {  // padding: nothing is written for it
    ptx::griddep_wait();
    return;
  }
  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);
  const int num_chunks = static_cast<int>((eos - bos + kChunk - 1) / kChunk);
  const int64_t slot0 = p.seqs.first_slot(n, bos);
  const int64_t record_stride = static_cast<int64_t>(H) * F16Record::kBytes;
  const uint8_t* records = p.records + slot0 * record_stride + static_cast<int64_t>(h) * F16Record::kBytes;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);  // tensor-map copies: 128-byte aligned
  __shared__ uint64_t full[kStages], empty[kStages];
  const StageRing<kStages> ring{full, empty};
  if (threadIdx.x == 0) ring.init(VW * 32);
  __syncthreads();
  if (warp == VW) {  // producer
    if (lane != 0) return;
    ptx::griddep_wait();  // after the prep grid (p.after_prep): its records are complete
    typename StageRing<kStages>::Cursor at;
    for (int c = 0; c < num_chunks; ++c) {
      if (c >= kStages) ring.wait_empty(at);
      fill_stage<F16Record>(smem + at.stage * kStageBytes, ring.full_barrier(at), records + int64_t{c} * record_stride,
                            &p.v_rows, h, bos + int64_t{c} * kChunk);
      at.advance();
    }
    return;
  }

  const int64_t initial_row0 = (start * H + h) * static_cast<int64_t>(kHeadDim) + vbase;
  NarrowState acc;
  load_narrow_state(acc, p.initial_state, p.initial_state_f32, initial_row0, lane);
  RowScale scale;
  init_column_scale(acc, scale);
  NarrowLaneOffsets offsets;
  offsets.init(lane);
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  uint16_t* out_head = p.out + bos * out_row_stride + h * kHeadDim;
  typename StageRing<kStages>::Cursor at;
  for (int c = 0; c < num_chunks; ++c) {
    const int64_t left = eos - bos - int64_t{c} * kChunk;
    ring.wait_full(at);
    chunk_step_narrow(acc, scale, smem + at.stage * kStageBytes, offsets, vbase, lane,
                      out_head + int64_t{c} * kChunk * out_row_stride, static_cast<int>(left < kChunk ? left : kChunk),
                      out_row_stride);
    ring.release(at);
    at.advance();
  }
  unscale_columns(acc, scale);
  if (const int64_t f = p.slots.final_slot(n, start); p.final_state && f >= 0) {
    const int64_t final_row0 = (f * H + h) * static_cast<int64_t>(kHeadDim) + vbase;
    store_narrow_state(acc, p.final_state, p.final_state_f32, final_row0, lane);
  }
}

template <int VW, int BLOCKS>
void launch_narrow(const StateParams& p, cudaStream_t stream) {
  constexpr auto kernel = state_narrow_kernel<VW, BLOCKS>;
  constexpr int kStages = stages_fitting(BLOCKS, 0);
  static_assert(kStages >= 3, "a pipeline of at least three stages");
  constexpr int kSmem = 128 + kStages * kStageBytes;
  static_assert(BLOCKS * (kSmem + 1024) <= kSmemPerSm && kSmem <= kMaxBlockSmem, "the stages must fit");
  static PerDeviceOnce raised;
  raised.run("narrow state kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const int64_t blocks = p.seqs.num_seqs * p.num_heads * (kHeadDim / (kNarrowWidth * VW));
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3((VW + 1) * 32), kSmem, stream, p.after_prep,
                "narrow state kernel", p);
}

}  // namespace

void launch_state_narrow(const StateParams& p, int value_slices, cudaStream_t stream) {
  if (!p.f16_records || p.k_major || p.checkpoints.count > 0 || p.split.segments > 0 || p.ready)
    fail(ErrorCode::kInternal, "narrow state kernel: the plain pass on F16Records only");
  if (value_slices == 8) launch_narrow<8, 1>(p, stream);
  else if (value_slices == 4) launch_narrow<4, 2>(p, stream);
  else fail(ErrorCode::kInternal, "narrow state kernel: 8 or 4 slices a block, got ", value_slices);
}

}  // namespace flashkda::gpu
