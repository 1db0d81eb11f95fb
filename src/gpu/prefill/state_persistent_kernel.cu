// Persistent form of the state pass, for more (sequence, head) items than multiprocessors.
//
// The per-(sequence, head) kernel (state_kernel.cu) starts every block with an empty pipeline
// and a state load from device memory, and ends it with the pipeline drained: for 8-chunk
// sequences (docs/benchmark.md's P9) that overhead outweighed the 8 chunk steps (23.6 us a block
// against 8 x 1.36 us), and one 288-thread block per multiprocessor hides none of it. Here one
// block per multiprocessor (8x1 layout) takes item blockIdx.x, then items from a counter in the
// workspace (zeroed by the prep kernel), so long and short items balance as the hardware's block
// scheduler would balance them, the longest sequences' first (seq_order, from the prep kernel);
// its producer warp streams the items' chunks back to back through one pipeline, and copies each
// item's initial state into shared memory as soon as the consumers have read the previous one,
// so no item starts with a device-memory load.
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/item_scheduler.cuh"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/state_step.cuh"
#include "gpu/prefill/state_step_f16.cuh"
#include "gpu/ptx/grid_sync.cuh"

namespace flashkda::gpu {
namespace {

using namespace state_pass;

constexpr int kWarps = 8;  // 8 value slices of 16 columns: the whole head, all key channels
constexpr int kThreads = (kWarps + 1) * 32;

// The staged initial state: the 128 rows (value columns) of one head's [V, K] state as tensor-map
// boxes of 128 rows x 128 bytes (encode_state_rows_map: 2 boxes in bf16, 4 in fp32) with the
// 128-byte swizzle, which keeps the fragment reads below conflict-free (bf16; fp32: 2-way) with
// unpadded rows. The 128 one-row bulk copies an item these replace (the padded rows needed one
// a row) cost ~24 us of P9's persistent pass in all (ncu, 852c515), by their number, not bytes.
constexpr uint32_t kStateBoxBytes = kHeadDim * 128;               // 128 rows x 128 bytes
constexpr uint32_t kStagedStateBytes = 4 * kStateBoxBytes;         // fp32: 4 boxes
constexpr uint32_t kSwizzleAlign = 1024;                           // the swizzle's atom: 8 rows x 128 bytes
// One block a multiprocessor: the stages that fit beside the staged state (and its alignment).
constexpr int kStages = stages_fitting(1, kStagedStateBytes + kSwizzleAlign);
constexpr int kSmem = 128 + kStages * kStageBytes + kSwizzleAlign + kStagedStateBytes;
static_assert(kSmem <= kMaxBlockSmem, "stages and the staged state must fit one block's shared memory");

// The state's register order (state_step.cuh): the A order measured faster here (P3 1.103 ms
// against 1.118, P9 0.443 against 0.449); the fp16 step (kF16 below) takes the C order.
template <bool kF16>
constexpr StateOrder kOrderOf = kF16 ? StateOrder::kC : StateOrder::kA;

// This lane's state registers of value columns [vbase, vbase + 16) from the staged state: pair
// (row R, columns C, C + 1) of box C / (64 or 32), row R, 16-byte chunk (C's byte / 16) ^ (R % 8)
// (R % 8 = g: vbase is a multiple of 16). The f32 pairs as two 4-byte loads: 8-byte ones
// (register pairs) made ptxas copy ~150 registers in the chunk loop (528 -> 692 instructions a
// step).
template <StateOrder kOrder>
__device__ __forceinline__ void load_staged_state(float (&acc)[kNTiles][4], const uint8_t* staged, bool f32,
                                                  int vbase, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* row = staged + static_cast<uint32_t>(vbase + g + 8 * r) * 128;
      float2 x;
      if (f32) {  // columns 8 nt + 2 t4: box nt / 4, byte 32 (nt % 4) + 8 t4
        const uint8_t* pair = row + (nt / 4) * kStateBoxBytes + (((2 * (nt % 4) + (t4 >> 1)) ^ g) * 16) + 8 * (t4 & 1);
        x = make_float2(reinterpret_cast<const float*>(pair)[0], reinterpret_cast<const float*>(pair)[1]);
      } else {  // box nt / 8, byte 16 (nt % 8) + 4 t4
        const uint8_t* pair = row + (nt / 8) * kStateBoxBytes + (((nt % 8) ^ g) * 16) + 4 * t4;
        x = ptx::unpack_bf16x2(*reinterpret_cast<const uint32_t*>(pair));
      }
      acc[nt][pair_first<kOrder>(r)] = x.x;
      acc[nt][pair_second<kOrder>(r)] = x.y;
    }
}

// This lane's part of the final state (value rows [row0, row0 + 16), all 128 key columns) with
// 16-byte stores. In the fragment order a lane holds two adjacent columns of each 8-column tile
// (a 4- or 8-byte store each: 32 store instructions a lane, 8 rows of half sectors each, and
// ncu at P9 put them on the global store queue's throttle); two exchanges in the lane's quad
// (lanes t4 ^ 1, then t4 ^ 2) give lane t4 whole 16-byte runs of one row instead: bf16, tiles
// 4k + t4 (8 stores); fp32 (one exchange), columns 4 (t4 / 2) .. + 3 of tiles 2m + t4 % 2 (16).
__device__ __forceinline__ uint2 shfl_xor_pair(uint2 x, int mask) {
  return make_uint2(__shfl_xor_sync(0xffffffffu, x.x, mask), __shfl_xor_sync(0xffffffffu, x.y, mask));
}

template <StateOrder kOrder, bool kF32>
__device__ __forceinline__ void store_state_wide(const float (&acc)[kNTiles][4], void* state, int64_t row0, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const bool odd = t4 & 1, high = t4 & 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + g + 8 * r;
    if constexpr (kF32) {
      float* dst = static_cast<float*>(state) + row * kHeadDim + 4 * (t4 >> 1);
#pragma unroll
      for (int m = 0; m < kNTiles / 2; ++m) {
        const uint2 lo = make_uint2(__float_as_uint(acc[2 * m][pair_first<kOrder>(r)]), __float_as_uint(acc[2 * m][pair_second<kOrder>(r)]));
        const uint2 hi = make_uint2(__float_as_uint(acc[2 * m + 1][pair_first<kOrder>(r)]),
                                    __float_as_uint(acc[2 * m + 1][pair_second<kOrder>(r)]));
        const uint2 got = shfl_xor_pair(odd ? lo : hi, 1);  // the even lane keeps tile 2m, the odd one 2m + 1
        const uint4 run = odd ? make_uint4(got.x, got.y, hi.x, hi.y) : make_uint4(lo.x, lo.y, got.x, got.y);
        *reinterpret_cast<uint4*>(dst + 8 * (2 * m + odd)) = run;
      }
    } else {
      uint32_t u[kNTiles];  // columns 8 nt + 2 t4, + 1
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) u[nt] = ptx::pack_bf16x2(acc[nt][pair_first<kOrder>(r)], acc[nt][pair_second<kOrder>(r)]);
      uint2 w[kNTiles / 2];  // columns 4 (t4 / 2) .. + 3 of tile 2m + t4 % 2
#pragma unroll
      for (int m = 0; m < kNTiles / 2; ++m) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? u[2 * m] : u[2 * m + 1], 1);
        w[m] = odd ? make_uint2(got, u[2 * m + 1]) : make_uint2(u[2 * m], got);
      }
      uint16_t* dst = static_cast<uint16_t*>(state) + row * kHeadDim;
#pragma unroll
      for (int k = 0; k < kNTiles / 4; ++k) {  // tile 4k + t4: w[2k] from the low lane, w[2k + 1] from the high
        const uint2 got = shfl_xor_pair(high ? w[2 * k] : w[2 * k + 1], 2);
        const uint4 run = high ? make_uint4(got.x, got.y, w[2 * k + 1].x, w[2 * k + 1].y)
                               : make_uint4(w[2 * k].x, w[2 * k].y, got.x, got.y);
        *reinterpret_cast<uint4*>(dst + 8 * (4 * k + t4)) = run;
      }
    }
  }
}

// kCheckpoints: as in state_kernel.cu, a kernel of its own (checkpoint code beside the plain
// kernel's chunk loop cost P3 and P9 3-4%). kF16: F16Records and the fp16 step (state_step_f16.cuh),
// each item's state rows scaled after its load and unscaled before its store.
template <bool kCheckpoints, bool kF16>
__global__ void __launch_bounds__(kThreads, 1) state_persistent_kernel(const __grid_constant__ StateParams p) {
  using Record = typename RecordOf<kF16 ? RecordForm::kF16 : RecordForm::kTf32>::type;
  constexpr StateOrder kOrder = kOrderOf<kF16>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H = p.num_heads;
  const int64_t items = p.seqs.num_seqs * H;  // item j: sequence j / H, head j % H
  const int64_t record_stride = static_cast<int64_t>(H) * Record::kBytes;
  const bool f32_in = p.initial_state_f32;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);  // tensor-map copies: 128-byte aligned
  uint8_t* staged = smem + kStages * kStageBytes;
  staged += (kSwizzleAlign - (ptx::smem_addr(staged) & (kSwizzleAlign - 1))) & (kSwizzleAlign - 1);
  // The handover passes one item at a time: its number, tokens and final-state slot (ItemInfo;
  // item -1 ends the loop) and, with an initial state, its staged copy. The producer looks the
  // item up (the order, the slot table, cu_seqlens) while the previous item's chunks are still
  // in flight, so the consumers start an item without a device-memory load of their own.
  struct ItemInfo {
    int64_t item, bos, final_slot;
    int len;
  };
  using Ring = StageRing<kStages>;
  __shared__ uint64_t full[kStages], empty[kStages], item_full[1], item_empty[1];
  const Ring ring{full, empty};
  const StageRing<1> handover{item_full, item_empty};  // one item at a time: ItemInfo and the staged state
  __shared__ volatile ItemInfo item_info[1];
  if (threadIdx.x == 0) {  // every consumer thread releases a stage and the handover
    ring.init(kWarps * 32);
    handover.init(kWarps * 32);
  }
  __syncthreads();
  const ItemScheduler items_left{p.item_counter};

  if (warp == kWarps) {  // producer: lane 0 fetches items, stages each one's state and fills the stages
    if (lane != 0) return;
    ptx::griddep_wait();  // after the prep grid (p.after_prep): the counter, the order and the records
    typename Ring::Cursor at;
    StageRing<1>::Cursor item_at;
    // Looks an item up: the k-th item taken is (sequence seq_order[k / H] or k / H, head k % H),
    // j = sequence H + head (-1: no more items); padding sequences' items are skipped (nothing is
    // written for them).
    struct Item {
      int64_t j = -1, start = 0, bos = 0, eos = 0, final_slot = -1;
    };
    auto look_up = [&](int64_t k) {
      Item it;
      for (;; k = items_left.next_work()) {
        if (k >= items) return it;
        const int64_t j = (p.seq_order ? p.seq_order[k / H] : k / H) * H + k % H;
        const int64_t start = p.slots.start(j / H);
        if (p.slots.runs(start, p.initial_state != nullptr)) {
          it.j = j, it.start = start;
          break;
        }
      }
      p.seqs.bounds(it.j / H, it.bos, it.eos);
      it.final_slot = p.final_state ? p.slots.final_slot(it.j / H, it.start) : -1;
      return it;
    };
    Item next = look_up(items_left.initial_work());
    for (;; item_at.advance()) {
      // The consumers read the previous item's number and state before its first chunk step.
      handover.wait_empty(item_at);
      uint64_t* const item_ready = handover.full_barrier(item_at);
      const Item it = next;
      const int64_t j = it.j;
      if (j < 0) {
        item_info->item = -1;  // no more items
        ptx::mbarrier_arrive(item_ready);
        return;
      }
      item_info->item = j;  // published by the arrive below (release)
      item_info->bos = it.bos;
      item_info->len = static_cast<int>(it.eos - it.bos);  // < 2^31 tokens
      item_info->final_slot = it.final_slot;
      if (p.initial_state) {
        const int boxes = f32_in ? 4 : 2, box_cols = f32_in ? 32 : 64;
        ptx::mbarrier_arrive_expect_tx(item_ready, boxes * kStateBoxBytes);
        const int slot_head = static_cast<int>(it.start * H + j % H);  // < 2^31 (the plan): a tensor-map coordinate
        for (int b = 0; b < boxes; ++b)
          ptx::tensor_copy_3d_g2s(staged + b * kStateBoxBytes, &p.initial_rows, b * box_cols, 0, slot_head, item_ready);
      } else {
        ptx::mbarrier_arrive(item_ready);
      }
      const int h = static_cast<int>(j % H);
      const int num_chunks = static_cast<int>((it.eos - it.bos + kChunk - 1) / kChunk);  // < 2^31 tokens
      const uint8_t* records =
          p.records + p.seqs.first_slot(j / H, it.bos) * record_stride + int64_t{h} * Record::kBytes;
      // The next item is looked up kLookAhead fills before this one's last (after the first for
      // shorter items), while the stages ahead keep the consumers busy: its hand-over then follows
      // the last fill at once. Looked up after the last fill (a counter atomic, then dependent
      // loads of the order, the slot table and cu_seqlens), it reached the consumers late: ncu at
      // P9 (8-chunk items) put 15% of the kernel's stall samples on the consumers' wait for it.
      // This took P9 from 0.432 to 0.426 ms (H200, same session). Not earlier, so that a block
      // takes its next item about when it would otherwise (the balance of unequal items).
      constexpr int kLookAhead = 4;
      const int look_at = num_chunks > kLookAhead ? num_chunks - kLookAhead : 0;
      for (int c = 0; c < num_chunks; ++c) {
        ring.wait_empty(at);
        fill_stage<Record>(smem + at.stage * kStageBytes, ring.full_barrier(at), records + int64_t{c} * record_stride,
                           &p.v_rows, h, it.bos + int64_t{c} * kChunk);
        at.advance();
        if (c == look_at) next = look_up(items_left.next_work());
      }
      if (num_chunks == 0) next = look_up(items_left.next_work());
    }
  }

  const int vbase = warp * 16;
  LaneOffsets offsets;
  offsets.init<kNTiles>(lane, 0);
  [[maybe_unused]] F16LaneOffsets f16_offsets;
  if constexpr (kF16) f16_offsets.init(lane);
  [[maybe_unused]] RowScale scale;
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  typename Ring::Cursor at;
  StageRing<1>::Cursor item_at;
  float acc[kNTiles][4];
#pragma unroll 1
  for (;; item_at.advance()) {
    handover.wait_full(item_at);
    const int64_t j = item_info->item;
    if (j < 0) break;
    const int64_t bos = item_info->bos, final_slot = item_info->final_slot;
    const int len = item_info->len;
    if (p.initial_state) load_staged_state<kOrder>(acc, staged, f32_in, vbase, lane);
    else load_state<kOrder>(acc, nullptr, false, 0, 0, lane);  // zeros
    handover.release(item_at);
    if constexpr (kF16) init_row_scale(acc, scale);
    const int h = static_cast<int>(j % H);
    uint16_t* out_head = p.out + bos * out_row_stride + h * kHeadDim;
    auto checkpoints = [&](int64_t tokens) {  // the true state (kF16: the registers keep their scales)
      if constexpr (kF16) write_checkpoints<kOrder>(p.checkpoints, acc, j / H, h, H, tokens, vbase, 0, lane, RowScaled{scale});
      else write_checkpoints<kOrder>(p.checkpoints, acc, j / H, h, H, tokens, vbase, 0, lane);
    };
    if constexpr (kCheckpoints) checkpoints(0);
    auto step = [&](int c) {
      ring.wait_full(at);
      const int left = len - c * kChunk;
      uint16_t* const out_chunk = out_head + int64_t{c} * kChunk * out_row_stride;
      if constexpr (kF16) {
        chunk_step_f16(acc, scale, smem + at.stage * kStageBytes, f16_offsets, vbase, lane, out_chunk,
                       left < kChunk ? left : kChunk, out_row_stride);
      } else {
        chunk_step<kOrder, 1>(acc, smem + at.stage * kStageBytes, offsets, vbase, 0, lane,
                              static_cast<SliceExchange<1>*>(nullptr), 0, out_chunk, left < kChunk ? left : kChunk,
                              out_row_stride);
      }
      ring.release(at);  // this thread's reads of the stage are done
      at.advance();
    };
    const int chunks = (len + kChunk - 1) / kChunk;
    if constexpr (kCheckpoints) {
      for (int c = 0; c < chunks;) {
        const int stop = p.checkpoints.next_boundary(j / H, c, chunks, kChunk);
        for (; c < stop; ++c) step(c);
        checkpoints(int64_t{stop} * kChunk);
      }
    } else {
      for (int c = 0; c < chunks; ++c) step(c);
    }
    if constexpr (kF16) unscale_rows(acc, scale);
    if (final_slot >= 0) {  // the dtype branch taken once, not predicated into every store
      const int64_t row0 = (final_slot * H + h) * kHeadDim + vbase;
      if (p.final_state_f32) store_state_wide<kOrder, true>(acc, p.final_state, row0, lane);
      else store_state_wide<kOrder, false>(acc, p.final_state, row0, lane);
    }
  }
}

}  // namespace

void launch_state_persistent(const StateParams& p, int sms, cudaStream_t stream) {
  if (p.k_major) fail(ErrorCode::kInternal, "persistent state kernel: K-major states take the per-item pass");
  const bool checkpoints = p.checkpoints.count > 0;
  const auto kernel = checkpoints ? (p.f16_records ? state_persistent_kernel<true, true> : state_persistent_kernel<true, false>)
                                  : (p.f16_records ? state_persistent_kernel<false, true> : state_persistent_kernel<false, false>);
  static PerDeviceOnce raised[4];  // the shared-memory limit, raised once per device the caller uses
  raised[2 * checkpoints + p.f16_records].run("persistent state kernel: setting its shared memory size", [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  const int64_t items = p.seqs.num_seqs * p.num_heads;
  const int64_t blocks = items < sms ? items : sms;  // one block per multiprocessor (shared memory)
  if (blocks == 0) return;
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), kSmem, stream, p.after_prep,
                "persistent state kernel", p);
}

}  // namespace flashkda::gpu
