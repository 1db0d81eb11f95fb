// The streaming form of the recurrent kernel: persistent warps, each taking work items of 16 value
// rows of one (sequence, head), with the state tiles of its next items in flight while it computes
// this one.
//
// Why: a decode step reads each state once and writes it once, so the copy bandwidth is the bound
// only while every multiprocessor keeps enough bytes in flight. A block that loads its tile, then
// computes, then stores (recurrent_kernel.cu) has nothing in flight while it computes; with the
// tile in bf16 that compute is as long as the load, and the block form reached 77% of the copy
// bandwidth (docs/perf-notes.md, Decode). Here each lane copies its own 16 runs of the tile
// kStages items ahead into its warp's shared-memory ring by cp.async and reads back only what it
// copied itself: no barrier of any kind, the warps of a block are independent.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "common/fail.h"
#include "gpu/decode/recurrent_launch.h"
#include "gpu/decode/recurrent_token.cuh"
#include "gpu/launch/per_device.h"
#include "gpu/ptx/cp_async.cuh"

namespace flashkda::gpu {
namespace {
using namespace recurrent;

constexpr int kWarps = 4;           // a block: 4 independent warps
constexpr int kBlocksPerSm = 4;     // 16 warps a multiprocessor at 128 registers a thread
constexpr int kThreads = kWarps * 32;

// A warp's shared memory: its ring of staged tiles (a lane's run r at runs[stage][r][lane], so a
// warp's reads of one run are 256 or 512 contiguous bytes) and its token prep. 8 KB of ring a
// warp either way: two bf16 tiles or one fp32 tile ahead, 44 KB a block.
template <bool kBf16>
struct WarpSmem {
  using Run = std::conditional_t<kBf16, uint2, float4>;  // four elements
  static constexpr int kStages = kBf16 ? 2 : 1;
  Run runs[kStages][kRuns][32];
  TokenPrep prep;
  const void* ahead[32];  // a lane's tile_source of the item kStages ahead, parked out of registers
};

// Work item `item` = ((n * H + h) * kWarpsPerHead + w): value rows 16 w .. 16 w + 15 of head h of
// sequence n. 32-bit: the launch takes fewer than 2^31 items.
struct Item {
  int n, h;
  LanePlace at;
};
__device__ __forceinline__ Item item_at(const RecurrentParams& p, int item, int lane) {
  const int head = item / kWarpsPerHead;
  return {head / p.num_heads, head % p.num_heads, lane_place(lane, item % kWarpsPerHead * kRowsPerWarp)};
}

// The lane's first run of `item`'s initial tile (the others at constant offsets from it), or
// nullptr when nothing is to be copied: past the last item, padding, no initial states.
template <StateLayout L, bool kBf16>
__device__ __forceinline__ const void* tile_source(const RecurrentParams& p, int item, int items, int lane) {
  if (item >= items || !p.initial_state) return nullptr;
  const Item it = item_at(p, item, lane);
  const int64_t start = p.slots.start(it.n);
  if (!p.slots.runs(start, true)) return nullptr;
  using E = std::conditional_t<kBf16, const uint16_t, const float>;
  return run_ptr<L>(static_cast<E*>(head_state(p.initial_state, kBf16, start, p.num_heads, it.h)), it.at.v0, it.at.kl, 0);
}

// Copies the lane's 16 runs from `src` (tile_source) into ring stage `stage` and commits them as
// one group; an empty group for nullptr, so that the count of groups stays one an item.
template <StateLayout L, bool kBf16>
__device__ __forceinline__ void stage_tile(WarpSmem<kBf16>& smem, int stage, const void* src, int lane) {
  if (src) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {  // run r sits at a constant offset from run 0 in both layouts
      using E = std::conditional_t<kBf16, const uint16_t, const float>;
      const void* run = static_cast<E*>(src) + Runs<L>::offset(r, 0, 0);
      if constexpr (kBf16) ptx::cp_async_8(&smem.runs[stage][r][lane], run);
      else ptx::cp_async_16(&smem.runs[stage][r][lane], run);
    }
  }
  ptx::cp_async_commit();
}

template <StateLayout L, bool kBf16>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) streaming_kernel(const RecurrentParams p, int items) {
  using Smem = WarpSmem<kBf16>;
  constexpr int kStages = Smem::kStages;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  Smem& smem = reinterpret_cast<Smem*>(smem_bytes)[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  const int stride = gridDim.x * kWarps;
  const int first = blockIdx.x * kWarps + threadIdx.x / 32;

#pragma unroll
  for (int k = 0; k < kStages; ++k) stage_tile<L, kBf16>(smem, k, tile_source<L, kBf16>(p, first + k * stride, items, lane), lane);

  int stage = 0;
  int parity = 0;  // token_step's prep buffer: alternates token by token, across items too
  for (int item = first; item < items; item += stride, stage = stage + 1 == kStages ? 0 : stage + 1) {
    // The tile kStages items ahead goes into this item's stage once this one has been read, in
    // the middle of the first token's step where registers are scarce: its source is found now
    // and parked in shared memory.
    smem.ahead[lane] = tile_source<L, kBf16>(p, item + kStages * stride, items, lane);
    ptx::cp_async_wait<kStages - 1>();  // this item's group is complete
    const Item it = item_at(p, item, lane);
    const int64_t start = p.slots.start(it.n);
    // fetch reads the stage into registers, refill then copies the tile ahead into it, each once
    // an item. refill comes after instructions that use every value read from the stage (the
    // first token's decay, or the final state's stores), so no copy can overtake a read.
    bool fetched = false, refilled = false;
    Tile s;
    auto fetch = [&] {
      if (fetched) return;
      fetched = true;
      if (!p.initial_state) {
        zero_tile(s);
        return;
      }
#pragma unroll
      for (int r = 0; r < kRuns; ++r) set_run<L>(s, r, smem.runs[stage][r][lane]);
    };
    auto refill = [&] {
      if (refilled) return;
      refilled = true;
      stage_tile<L, kBf16>(smem, stage, smem.ahead[lane], lane);
    };
    if (!p.slots.runs(start, p.initial_state != nullptr)) {  // padding: nothing is written for it
      refill();
      continue;
    }
    int64_t bos, eos;
    p.seqs.bounds(it.n, bos, eos);
    const int64_t len = eos - bos;
    TokenInputs next;
    if (len > 0) next = load_token(p, batch_row(p, it.n), bos, it.h, it.at);

    for (int64_t t = 0; t < len; ++t) {
      if (p.checkpoints.count > 0 && t % 16 == 0) {
        fetch();
        write_checkpoints<L>(p, s, it.n, it.h, t, it.at);
      }
      const TokenInputs x = next;
      if (t + 1 < len) next = load_token(p, batch_row(p, it.n), bos + t + 1, it.h, it.at);  // in flight during this token

      float o[kRowsPerLane];
      const HeadGate gate = head_gate(p, it.h, lane);  // loaded a token (L1 hits): registers free between tokens
      token_step(p, s, smem.prep, parity, x, gate, it.at, o, fetch, refill);
      parity ^= 1;
      store_out(p, o, bos + t, it.h, it.at);
      store_token_state<L>(p, s, it.n, t, it.h, it.at);
    }
    fetch();  // a sequence without tokens
    if (p.checkpoints.count > 0 && len % 16 == 0) write_checkpoints<L>(p, s, it.n, it.h, len, it.at);
    store_final_state<L>(p, s, it.n, p.slots.start(it.n), it.h, it.at);  // read again: two registers fewer
    refill();
  }
  ptx::cp_async_wait<0>();  // no copy outlives the block (the last groups are empty)
}

template <StateLayout L, bool kBf16>
void launch(const RecurrentParams& p, int items, cudaStream_t stream) {
  // kBlocksPerSm blocks need 4 x 45 KB of the unified L1 / shared memory as shared memory: ask
  // for the largest carveout rather than trust the driver's default split.
  static PerDeviceOnce carved;
  carved.run("streaming recurrent kernel: setting its shared-memory carveout", [] {
    return cudaFuncSetAttribute(streaming_kernel<L, kBf16>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared);
  });
  const int blocks = std::min((items + kWarps - 1) / kWarps, multiprocessor_count() * kBlocksPerSm);
  streaming_kernel<L, kBf16><<<blocks, kThreads, kWarps * sizeof(WarpSmem<kBf16>), stream>>>(p, items);
}

}  // namespace

static_assert(kWarps * sizeof(WarpSmem<true>) <= 48 * 1024 && kWarps * sizeof(WarpSmem<false>) <= 48 * 1024,
              "a block's ring and prep fit the default dynamic shared memory (no attribute to set)");

void launch_recurrent_streaming(const RecurrentParams& p, StateLayout layout, cudaStream_t stream) {
  const int64_t items = p.seqs.num_seqs * p.num_heads * kWarpsPerHead;
  if (items == 0) return;
  if (items > INT_MAX)  // the plan takes the block form then (cuda_plan.cu)
    fail(ErrorCode::kInternal, "the streaming recurrent kernel was given ", items, " work items; it takes fewer than 2^31");
  const bool bf16 = p.initial_state && p.initial_bf16;
  const int n = static_cast<int>(items);
  if (layout == StateLayout::kVK) bf16 ? launch<StateLayout::kVK, true>(p, n, stream) : launch<StateLayout::kVK, false>(p, n, stream);
  else bf16 ? launch<StateLayout::kKV, true>(p, n, stream) : launch<StateLayout::kKV, false>(p, n, stream);
}

}  // namespace flashkda::gpu
