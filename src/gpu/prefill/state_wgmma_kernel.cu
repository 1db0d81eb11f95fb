// The state pass on wgmma (experimental; FLASHKDA_STATE_WGMMA=1 forces it, nothing chooses it
// yet): the chunk step of state_kernel.cu with every B operand read from shared memory once a
// warpgroup instead of once a warp. ncu showed the 8x1 mma.sync pass bound by shared-memory
// bandwidth (95% busy at P1: each of its 8 warps reads the whole record every chunk).
//
// One block of 256 threads per (sequence, head): two warpgroups of 64 value rows each (warp w of
// warpgroup wg holds rows 64 wg + 16 w .. + 15 of S^T [128 v][128 k] as an m64n128 accumulator,
// the same fragments as one 8x1 warp's, so state loads, stores and out stores are
// state_step.cuh's). Thread 0 also keeps the chunks (WgmmaRecord + the v rows) in flight: it
// refills a stage a step after every thread has released it. No producer warp: a ninth warp caps
// every thread at 168 registers (3 warps on a quarter of the register file) and the kernel needs
// 188; a producer warpgroup with setmaxnreg still compiled the step at 168 (ptxas C7512). The
// chunk step, on WgmmaRecord (chunk_record.cuh), is state_wgmma_step.cuh's; test_wgmma_step_gpu runs
// it alone against fp64. Per item, or (kSplit) the segment-parallel pass's runs (StateSplit in
// kernels.h, as state_kernel.cu's): a block a head and run, blockIdx.y the run. kTail: the split
// pass beside a prep tail (PrepTail in kernels.h) on the multiprocessors its runs leave (P7,
// P11: 12 of 132): launched right after the tail's grid; thread 0 waits once, before the first
// copy of its segment's tail, for the whole tail to be written, and every thread waits for the
// prep grids to finish before it exits. One wait a run, not one a record as the 8x1 pass's
// producer warp does: here thread 0's refills sit on the chain's path (every thread is a
// consumer), and a per-record test there (a division, then an acquire and a proxy fence a tail
// record) made the pass 15% slower with every flag already set (ncu at P7, a9fce7c: 390.5 us
// against 339.7). V-major states, no checkpoints, no persistent form: other calls keep the
// mma.sync passes.
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/state_step.cuh"
#include "gpu/prefill/state_wgmma_step.cuh"
#include "gpu/ptx/grid_sync.cuh"

namespace flashkda::gpu {
namespace {

using namespace state_pass;

constexpr int kStages = 6;
constexpr int kRefillLag = 1;  // steps between a stage's release and its refill
constexpr uint32_t kWgmmaStageBytes = WgmmaRecord::kBytes + kVRowBytes;  // 31.5 KB
constexpr int kConsumers = 256;                                       // two warpgroups
constexpr int kThreads = kConsumers;
constexpr int kSmem = 128 + kStages * kWgmmaStageBytes;
static_assert(kWgmmaStageBytes % 128 == 0 && kSmem <= kMaxBlockSmem, "stages aligned, and within a block's memory");

// kTail: the step whose refill is chunk `tail_fill` (step i refills chunk i - kRefillLag +
// kStages), before which thread 0 waits for the tail; 0 where that chunk is among the first
// fills, which wait themselves.
constexpr int tail_wait_step(int tail_fill) { return tail_fill >= kStages ? tail_fill - kStages + kRefillLag : 0; }
static_assert(tail_wait_step(kStages - 1) == 0 && tail_wait_step(kStages) - kRefillLag + kStages == kStages &&
                  tail_wait_step(40) - kRefillLag + kStages == 40 && tail_wait_step(kStages) > 0,
              "the wait comes before the refill of chunk tail_fill, and after step 0");

// kTail: every record of the prep tail written (PrepTail::done counts them after their flags).
__device__ __forceinline__ void wait_tail_done(const StateParams& p) {
  const unsigned total = static_cast<unsigned>(p.tail_chunks.count()) * static_cast<unsigned>(p.num_heads);
  while (ptx::load_acquire_gpu(p.tail_done) < total) ptx::nanosleep(128);
  ptx::fence_proxy_async_global();  // the acquire before the bulk copies' reads of the records
}

template <bool kSplit, bool kTail = false>
__global__ void __launch_bounds__(kThreads, 1) state_wgmma_kernel(const __grid_constant__ StateParams p) {
  static_assert(!kTail || kSplit, "the prep tail runs beside the split pass here");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = p.num_heads;
  const int64_t n = blockIdx.x / H;
  const int h = static_cast<int>(blockIdx.x % H);
  const int64_t start = p.slots.start(n);
  if (!p.slots.runs(start, p.initial_state != nullptr)) {  // padding: nothing is written for it
    ptx::griddep_wait();  // a grid whose blocks all leave here still ends after the one before it
    return;
  }
  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);
  const int num_chunks = static_cast<int>((eos - bos + kChunk - 1) / kChunk);  // < 2^31 tokens
  int c_begin = 0, c_end = num_chunks;  // the chunks this block runs
  const int run = kSplit ? static_cast<int>(blockIdx.y) : 0;
  const int segment = StateSplit::segment_of(run);
  const bool a_run = kSplit && StateSplit::is_a_run(run);
  if constexpr (kSplit) StateSplit::segment_chunks(num_chunks, p.split.segments, segment, c_begin, c_end);
  const int64_t record_stride = static_cast<int64_t>(H) * WgmmaRecord::kBytes;
  const uint8_t* records =
      p.records + p.seqs.first_slot(n, bos) * record_stride + static_cast<int64_t>(h) * WgmmaRecord::kBytes;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);  // tensor-map destinations
  using Ring = StageRing<kStages>;
  __shared__ uint64_t full[kStages], empty[kStages];
  const Ring ring{full, empty};
  if (threadIdx.x == 0) ring.init(kConsumers);  // every consumer thread releases a stage
  __syncthreads();

  // The A run reads v as zeros: a tile that starts at the problem's end is all padding.
  const int64_t v_token0 = a_run ? p.seqs.total_tokens : bos;
  // kTail: the fill of the first chunk of this segment's tail (the last per_segment chunks of
  // every segment, N = 1), before which thread 0 waits for the tail once.
  const int tail_fill = kTail ? c_end - p.tail_chunks.per_segment - c_begin : -1;
  // Thread 0: the run's chunk c_begin + i into its stage (free: first lap, or waited for).
  auto fill = [&](int i) {
    const auto to = Ring::Cursor::of_fill(i);
    const int c = c_begin + i;
    fill_stage<WgmmaRecord>(smem + to.stage * kWgmmaStageBytes, ring.full_barrier(to), records + int64_t{c} * record_stride,
                            &p.v_rows, h, a_run ? v_token0 : v_token0 + int64_t{c} * kChunk);
  };
  const int chunks = c_end - c_begin;
  if (threadIdx.x == 0) {
    // After the prep grid (p.after_prep): its records are complete from here on. The tail's are
    // waited for before the fill of the segment's first tail chunk instead.
    if constexpr (!kTail) ptx::griddep_wait();
    for (int i = 0; i < chunks && i < kStages; ++i) {
      if (kTail && i == tail_fill) wait_tail_done(p);
      fill(i);
    }
  }

  const int vbase = 64 * (warp / 4) + 16 * (warp % 4);
  const int64_t state_row0 = (n * H + h) * static_cast<int64_t>(kHeadDim) + vbase;  // the split buffers'
  float acc[kNTiles][4];
  // C order: wgmma's accumulator holds C fragments.
  if (!kSplit || run == 0)
    load_state<StateOrder::kC>(acc, p.initial_state, p.initial_state_f32,
                               (start * H + h) * static_cast<int64_t>(kHeadDim) + vbase, 0, lane);
  else if (!a_run) load_state<StateOrder::kC>(acc, nullptr, false, 0, 0, lane);  // zeros
  else load_identity<StateOrder::kC>(acc, vbase, 0, lane);
  float(&s_acc)[64] = reinterpret_cast<float(&)[64]>(acc);
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  auto run_chunks = [&](auto* out) {
    auto* out_head = out + bos * out_row_stride + h * kHeadDim;
    typename Ring::Cursor at;
    auto steps = [&](int i, int end) {
      for (; i < end; ++i) {
        const int c = c_begin + i;
        ring.wait_full(at);
        const int64_t left = eos - bos - int64_t{c} * kChunk;
        wgmma_chunk_step(s_acc, smem + at.stage * kWgmmaStageBytes, vbase, lane, out_head + int64_t{c} * kChunk * out_row_stride,
                         static_cast<int>(left < kChunk ? left : kChunk), out_row_stride);
        ring.release(at);  // this thread's reads of the stage are done
        // Thread 0 refills the stage of the previous chunk, which every thread released a step ago:
        // waiting for this chunk's stage instead held warpgroup 0 until warpgroup 1 finished the
        // step (1.23 us a chunk at P1 against 0.99 for the step alone).
        if (const int done = i - kRefillLag; threadIdx.x == 0 && done >= 0 && done + kStages < chunks) {
          ring.wait_empty(Ring::Cursor::of_fill(done + kStages));  // every thread released chunk done's reads
          fill(done + kStages);
        }
        at.advance();
      }
    };
    // kTail: the steps up to the one that refills chunk tail_fill, thread 0's wait, the rest. A
    // test in every refill instead made the step loop 13 instructions longer, and the kernel 8 us
    // slower than the split kernel without a tail (ncu at P7, every flag set).
    const int wait_step = kTail ? tail_wait_step(tail_fill) : 0;
    if (wait_step > 0) {
      steps(0, wait_step);
      if (threadIdx.x == 0) wait_tail_done(p);
    }
    steps(wait_step, chunks);
  };
  if (!kSplit || run == 0) run_chunks(p.out);
  else run_chunks(p.split.run_out(run));

  if constexpr (kSplit) {
    const int64_t state_elems = p.seqs.num_seqs * H * int64_t{kHeadDim} * kHeadDim;  // one state a buffer
    store_state<StateOrder::kC>(acc, p.split.run_final(run, state_elems), true, state_row0, 0, lane);
  } else if (const int64_t f = p.slots.final_slot(n, start); p.final_state && f >= 0) {
    store_state<StateOrder::kC>(acc, p.final_state, p.final_state_f32, (f * H + h) * static_cast<int64_t>(kHeadDim) + vbase, 0, lane);
  }
  if constexpr (kTail) ptx::griddep_wait();  // the work after the call finds the prep grids done
}

}  // namespace

void launch_state_wgmma(const StateParams& p, cudaStream_t stream) {
  if (p.checkpoints.count > 0 || p.k_major || p.item_counter)
    fail(ErrorCode::kInternal, "wgmma state kernel: V-major, no checkpoints, not persistent only");
  const bool split = p.split.segments > 0, tail = p.ready != nullptr;
  if (tail && !split) fail(ErrorCode::kInternal, "wgmma state kernel: a prep tail beside the split pass only");
  const auto kernel = tail ? state_wgmma_kernel<true, true> : split ? state_wgmma_kernel<true> : state_wgmma_kernel<false>;
  static PerDeviceOnce raised[3];  // the shared-memory limit, raised once per device the caller uses
  raised[split + tail].run("wgmma state kernel: setting its shared memory size", [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const int64_t blocks = p.seqs.num_seqs * p.num_heads;
  if (blocks == 0) return;
  const dim3 grid(static_cast<unsigned>(blocks), split ? 2 * p.split.segments - 1 : 1);
  // Beside a prep tail: programmatically after the tail's grid (each tail block lets it at its start).
  launch_kernel(kernel, grid, dim3(kThreads), kSmem, stream, tail || p.after_prep, "wgmma state kernel", p);
}

}  // namespace flashkda::gpu
