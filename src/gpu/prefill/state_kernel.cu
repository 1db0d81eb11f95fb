// State-pass kernel: the sequential part of the chunked recurrence.
//
// Each warp owns 16 value columns of one (sequence, head) and keeps that slice of the state,
// transposed (S^T [16 v][128 k], the storage layout), in fp32 registers for the whole sequence
// (as mma C or A fragments: state_step.cuh's StateOrder). Value columns never mix, so the
// slices of a head need no communication; a block holds several slices of one head (or one
// slice split over warps by key channels) that share the chunk records streamed into shared
// memory by the copy engine (kStages deep). Per chunk, with the record of chunk_record.cuh:
//   X^T = S^T Wk^T,  U^T = WV^T - X^T,  O^T = S^T Qe^T + WV^T M^T,  S^T = S^T D + U^T Kr.
// The products run on the tensor cores in tf32 (fp32 state, records in tf32 or bf16, both exact
// as tf32 operands): the C fragments of S^T, X^T and U^T become the A fragments of the next
// product with no conversion, k permuted (mma.cuh). (A bf16 variant needed hi/lo splits of S,
// U, WV and Kr to stay under the 5e-3 bar on large states with little decay, and those splits
// cost more instructions than the products.)
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/state_step.cuh"
#include "gpu/prefill/state_step_f16.cuh"
#include "gpu/ptx/grid_sync.cuh"

namespace flashkda::gpu {
namespace {

using namespace state_pass;

// kTail (StateParams::ready): waits until the record of (slot, head h) is written where the tail
// writes it; the proxy fence orders the flag's acquire before the bulk copy's reads of the record.
__device__ __forceinline__ void wait_tail_record(const StateParams& p, int64_t slot, int h) {
  if (!p.tail_chunks.holds(static_cast<int>(slot))) return;  // one sequence: slot = chunk (< 2^27)
  const uint32_t* flag = p.ready + slot * p.num_heads + h;
  while (ptx::load_acquire_gpu(flag) == 0) ptx::nanosleep(64);
  ptx::fence_proxy_async_global();
}

// Block = VW value slices x KS key parts (one warp each) of one (sequence, head), plus one
// producer warp that keeps kStages chunks in flight: each step waits on its stage, so the copy
// latency must hide behind kStages - 1 steps, and no computing warp ever waits to refill.
// BLOCKS: the blocks a multiprocessor the layout is meant to run; the stages are as many as
// shared memory then holds (stages_fitting).
//
// kSplit: the segment-parallel form (StateSplit in kernels.h). Each sequence's chunks are cut
// into S segments and blockIdx.y picks the run: 0 runs segment 0 from the initial state (out as
// usual, final state -> boundary[0]); 2s - 1 runs segment s from zero (out -> out_b, final ->
// b_t[s - 1]); 2s runs segment s from the identity with v = 0 (out -> out_a, final ->
// a_t[s - 1]). The 2S - 1 chains take 1/S of the steps and run at once; the stitch kernel
// combines them.
//
// kServing: the serving features the plain kernel leaves out, checked at run time: the run stops
// at the chunk boundaries that prefix checkpoints ask for and stores the state there, and states
// and checkpoints may be K-major (p.k_major). A kernel of its own: any checkpoint code in or
// beside the chunk loop of the plain kernel (a check per chunk, or a second copy of the loop)
// cost P1, P3 and P7 3-8%.
//
// kTail: the 8x1 form with a prep tail (PrepTail in kernels.h): launched right after the tail's
// prep grid, its producer waits on the tail records' ready flags, and the consumers wait for the
// prep grid to finish before they exit (the work after the call, the next call's zeroing of the
// flags among it, must find it done). A kernel of its own, so the plain 8x1 kernel stays as
// measured.
//
// kF16: the KS = 1 layouts (8x1 plain, tail and serving; 4x1 plain and serving) on F16Records,
// the fp16 step (state_step_f16.cuh): each warp's state rows at a scale of their own (RowScale),
// applied after the load, taken off before the final store and applied as checkpoints are
// stored (the registers keep theirs: a checkpoint is a prefix prefill's state bit for bit).
// Shared memory of a block beside its stages: two exchange areas per slice when KS > 1.
template <int VW, int KS>
constexpr int kExchangeBytes = KS > 1 ? 2 * VW * static_cast<int>(sizeof(SliceExchange<KS>)) : 0;

// The stages of a layout run at BLOCKS blocks a multiprocessor: as many as shared memory holds.
template <int VW, int KS, int BLOCKS>
constexpr int kLayoutStages = stages_fitting(BLOCKS, kExchangeBytes<VW, KS>);

static_assert(kLayoutStages<8, 1, 1> == 6 && kLayoutStages<1, 4, 1> == 6 && kLayoutStages<4, 1, 2> == 4 &&
                  kLayoutStages<2, 2, 2> == 3 && kLayoutStages<1, 4, 2> == 3,
              "8x1 / 1x4: 6 stages; 4x1: 4; 2x2 and the compact split: 3 (launch_state)");

template <int VW, int KS, int BLOCKS, bool kSplit, bool kServing = false, bool kTail = false, bool kF16 = false>
__global__ void __launch_bounds__((VW * KS + 1) * 32, 1) state_kernel(const __grid_constant__ StateParams p) {
  static_assert(!(kSplit && kServing), "checkpoint and K-major calls never take the split pass");
  static_assert(!kTail || (VW == 8 && !kSplit && !kServing), "the prep tail runs beside the plain 8x1 pass");
  static_assert(!kF16 || (KS == 1 && (VW == 8 || VW == 4) && !kSplit), "the fp16 step: the 8x1 and 4x1 forms");
  using Record = typename RecordOf<kF16 ? RecordForm::kF16 : RecordForm::kTf32>::type;
  constexpr int kStages = kLayoutStages<VW, KS, BLOCKS>;
  constexpr int kWarps = VW * KS;
  constexpr int kGroups = 8 / VW;  // blocks per head
  // The state's register order (state_step.cuh). The C order where it measured faster: the 8x1
  // layout (P1 1.188 ms against 1.216) and the split pass (P7 1.128 against 1.137); the A order
  // elsewhere (4x1: P4 0.730 against 0.771, P10 1.47 against 1.63). A layout's serving form
  // keeps its plain form's order: the two do the same arithmetic, so that a checkpoint equals a
  // prefill of the prefix bit for bit (the order changes the state update's rounding).
  // The fp16 step takes the C order (its products' A fragments are the C fragments packed).
  constexpr StateOrder kOrder = kF16 || kSplit || (VW == 8 && KS == 1) ? StateOrder::kC : StateOrder::kA;
  constexpr int kTiles = kNTiles / KS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int vslice = warp / KS, kpart = warp % KS;
  const int H = p.num_heads;
  const int64_t head_block = blockIdx.x / kGroups;
  const int h = static_cast<int>(head_block % H);
  const int64_t n = head_block / H;
  const int vbase = (static_cast<int>(blockIdx.x % kGroups) * VW + vslice) * 16;

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
  const int64_t slot0 = p.seqs.first_slot(n, bos);
  const int64_t record_stride = static_cast<int64_t>(H) * Record::kBytes;
  const uint8_t* records = p.records + slot0 * record_stride + static_cast<int64_t>(h) * Record::kBytes;

  // Dynamic shared memory: kStages stages, then (KS > 1) two exchange areas per slice.
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // Tensor-map copies need 128-byte aligned destinations: align by hand (kSmem has the slack).
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);
  auto* exchange = reinterpret_cast<SliceExchange<KS>*>(smem + kStages * kStageBytes);
  __shared__ uint64_t full[kStages], empty[kStages];
  const StageRing<kStages> ring{full, empty};
  if (threadIdx.x == 0) ring.init(kWarps * 32);  // every consumer thread releases a stage
  __syncthreads();
  auto chunk_count = [&](int c) {
    const int64_t left = eos - bos - int64_t{c} * kChunk;
    return static_cast<int>(left < kChunk ? left : kChunk);
  };
  if (warp == kWarps) {  // producer
    if (lane != 0) return;
    // After the prep grid (p.after_prep): its records are complete from here on. The tail's
    // records are waited for one by one below instead.
    if constexpr (!kTail) ptx::griddep_wait();
    typename StageRing<kStages>::Cursor at;
    // The A run reads v as zeros: a tile that starts at the problem's end is all padding.
    const bool zero_v = a_run;
    for (int c = c_begin; c < c_end; ++c) {
      // The first lap's waits would return at once; skipping them keeps the 8x1 step loop's
      // schedule as measured (with them ptxas reordered it).
      if (c - c_begin >= kStages) ring.wait_empty(at);
      if constexpr (kTail) {
        wait_tail_record(p, slot0 + c, h);
      }
      fill_stage<Record>(smem + at.stage * kStageBytes, ring.full_barrier(at), records + int64_t{c} * record_stride,
                         &p.v_rows, h, zero_v ? p.seqs.total_tokens : bos + int64_t{c} * kChunk);
      at.advance();
    }
    return;
  }

  const int64_t state_row0 = (n * H + h) * static_cast<int64_t>(kHeadDim) + vbase;  // the split buffers'
  const int64_t initial_row0 = (start * H + h) * static_cast<int64_t>(kHeadDim) + vbase;
  const int col0 = kpart * kTiles * 8;
  float acc[kTiles][4];
  const bool k_major = kServing && p.k_major;
  if (k_major) load_state<kOrder, true>(acc, p.initial_state, p.initial_state_f32, initial_row0, col0, lane);
  else if (!kSplit || run == 0) load_state<kOrder>(acc, p.initial_state, p.initial_state_f32, initial_row0, col0, lane);
  else if (!a_run) load_state<kOrder>(acc, nullptr, false, state_row0, col0, lane);  // zeros
  else load_identity<kOrder>(acc, vbase, col0, lane);
  [[maybe_unused]] RowScale scale;
  if constexpr (kF16) init_row_scale(acc, scale);

  auto checkpoints = [&](int64_t tokens) {
    auto write = [&](auto scaled) {
      if (k_major) write_checkpoints<kOrder, true>(p.checkpoints, acc, n, h, H, tokens, vbase, col0, lane, scaled);
      else write_checkpoints<kOrder>(p.checkpoints, acc, n, h, H, tokens, vbase, col0, lane, scaled);
    };
    if constexpr (kF16) write(RowScaled{scale});
    else write(Unscaled{});
  };
  if constexpr (kServing) checkpoints(0);
  LaneOffsets offsets;
  offsets.init<kTiles>(lane, kpart);
  [[maybe_unused]] F16LaneOffsets f16_offsets;
  if constexpr (kF16) f16_offsets.init(lane);
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  auto run_chunks = [&](auto* out) {
    auto* out_head = out + bos * out_row_stride + h * kHeadDim;
    typename StageRing<kStages>::Cursor at;
    auto step = [&](int c) {
      ring.wait_full(at);
      if constexpr (kF16) {
        chunk_step_f16(acc, scale, smem + at.stage * kStageBytes, f16_offsets, vbase, lane,
                       out_head + int64_t{c} * kChunk * out_row_stride, chunk_count(c), out_row_stride);
      } else {
        // Exchange areas alternate by chunk: a slice's warps meet at one barrier per chunk, and
        // a warp writing area (c & 1) knows every partner has finished reading it at chunk c - 2.
        chunk_step<kOrder, KS>(acc, smem + at.stage * kStageBytes, offsets, vbase, kpart, lane,
                               exchange + (c & 1) * VW + vslice, 1 + vslice, out_head + int64_t{c} * kChunk * out_row_stride,
                               chunk_count(c), out_row_stride);
      }
      ring.release(at);  // this thread's reads of the stage are done
      at.advance();
    };
    if constexpr (kServing) {
      for (int c = c_begin; c < c_end;) {
        const int stop = p.checkpoints.next_boundary(n, c, c_end, kChunk);
        for (; c < stop; ++c) step(c);
        checkpoints(int64_t{stop} * kChunk);
      }
    } else {
      for (int c = c_begin; c < c_end; ++c) step(c);
    }
  };
  if (!kSplit || run == 0) run_chunks(p.out);
  else run_chunks(p.split.run_out(run));
  if constexpr (kF16) unscale_rows(acc, scale);

  if constexpr (kSplit) {
    const int64_t state_elems = p.seqs.num_seqs * H * int64_t{kHeadDim} * kHeadDim;  // one state a buffer
    store_state<kOrder>(acc, p.split.run_final(run, state_elems), true, state_row0, col0, lane);
  } else if (const int64_t f = p.slots.final_slot(n, start); p.final_state && f >= 0) {
    const int64_t final_row0 = (f * H + h) * static_cast<int64_t>(kHeadDim) + vbase;
    if (k_major) store_state<kOrder, true>(acc, p.final_state, p.final_state_f32, final_row0, col0, lane);
    else store_state<kOrder>(acc, p.final_state, p.final_state_f32, final_row0, col0, lane);
  }
  if constexpr (kTail) ptx::griddep_wait();
}

template <int VW, int KS, int BLOCKS, bool kSplit, bool kServing = false, bool kTail = false, bool kF16 = false>
void launch_state_config(const StateParams& p, cudaStream_t stream) {
  if constexpr (!kSplit && !kServing && !kTail && !kF16) {
    const bool serving = p.checkpoints.count > 0 || p.k_major;
    if constexpr (KS == 1) {
      if (p.f16_records && serving) return launch_state_config<VW, KS, BLOCKS, false, true, false, true>(p, stream);
      if constexpr (VW == 8) {
        if (p.f16_records && p.ready) return launch_state_config<VW, KS, BLOCKS, false, false, true, true>(p, stream);
      }
      if (p.f16_records) return launch_state_config<VW, KS, BLOCKS, false, false, false, true>(p, stream);
    }
    if (serving) return launch_state_config<VW, KS, BLOCKS, false, true>(p, stream);
    if constexpr (VW == 8) {
      if (p.ready) return launch_state_config<VW, KS, BLOCKS, false, false, true>(p, stream);
    }
  }
  if (p.ready && !kTail) fail(ErrorCode::kInternal, "state kernel: only the plain 8x1 pass runs beside a prep tail");
  if (p.f16_records && !kF16) fail(ErrorCode::kInternal, "state kernel: only the 8x1 and 4x1 passes take the fp16 step");
  constexpr auto kernel = state_kernel<VW, KS, BLOCKS, kSplit, kServing, kTail, kF16>;
  constexpr int kStages = kLayoutStages<VW, KS, BLOCKS>;
  static_assert(kStages >= 3, "a pipeline of at least three stages");
  constexpr int kSmem = 128 + kStages * kStageBytes + kExchangeBytes<VW, KS>;
  static_assert(BLOCKS * (kSmem + 1024) <= kSmemPerSm && kSmem <= kMaxBlockSmem, "the stages must fit");
  static PerDeviceOnce raised;  // the shared-memory limit, raised once per device the caller uses
  raised.run("state kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const int64_t blocks = p.seqs.num_seqs * p.num_heads * (8 / VW);
  const dim3 grid(static_cast<unsigned>(blocks), kSplit ? 2 * p.split.segments - 1 : 1);
  constexpr int kThreads = (VW * KS + 1) * 32;
  // The tail's state grid starts programmatically after the tail grid (each tail block lets it
  // at its start), the others after the prep grid where p.after_prep says it ran just before.
  launch_kernel(kernel, grid, dim3(kThreads), kSmem, stream, kTail || p.after_prep, "state kernel", p);
}

}  // namespace

void launch_state(const StateParams& p, StateConfig config, cudaStream_t stream) {
  // Template arguments: the layout (VW x KS) and the blocks a multiprocessor it is meant to run
  // (8x1 and 1x4: one; 4x1, 2x2 and the compact split: two); the stages (kStageBytes, 26.75 KB)
  // are as many as shared memory then holds, at most 6 (the static_assert above).
  if (p.split.segments > 0) {  // the segment-parallel form runs the few-heads layouts
    if (p.k_major || p.checkpoints.count > 0)
      fail(ErrorCode::kInternal, "state kernel: the split pass takes neither K-major states nor checkpoints");
    const bool two_by_two = config.value_slices == 2 && config.key_parts == 2;
    if (!two_by_two && (config.value_slices != 1 || config.key_parts != 4))
      fail(ErrorCode::kInternal, "state kernel: the split pass runs the 1x4 and 2x2 layouts only");
    if (two_by_two) {
      if (p.split.compact) launch_state_config<2, 2, 2, true>(p, stream);
      else launch_state_config<2, 2, 1, true>(p, stream);
    } else if (p.split.compact) {
      launch_state_config<1, 4, 2, true>(p, stream);
    } else {
      launch_state_config<1, 4, 1, true>(p, stream);
    }
  } else if (config.value_slices == 8 && config.key_parts == 1) launch_state_config<8, 1, 1, false>(p, stream);
  else if (config.value_slices == 4 && config.key_parts == 1) launch_state_config<4, 1, 2, false>(p, stream);
  else if (config.value_slices == 2 && config.key_parts == 2) launch_state_config<2, 2, 2, false>(p, stream);
  else if (config.value_slices == 1 && config.key_parts == 4) launch_state_config<1, 4, 1, false>(p, stream);
  else
    fail(ErrorCode::kInternal, "state kernel: unsupported configuration ", config.value_slices, " x ",
         config.key_parts);
}

}  // namespace flashkda::gpu
