// The recurrent kernel: the per-token definition of docs/contract.md with the state in registers
// (the token step and the lane layout: recurrent_token.cuh).
//
// A decode step is a streaming problem (read each state once, write it once), so the layout is
// chosen for the memory system: one warp-sized block per (sequence, head, 16 value rows), each
// lane loading its tile once. Blocks of one warp, not four: the block scheduler refills a
// multiprocessor a warp at a time, so loads and arithmetic of its 16 warps stay out of step (D2
// on the H200: 0.149 ms against 0.151 with two warps a block and 0.153 with four). When out is
// the very buffer of q, k, v or g (an exact alias the contract allows), one block of 256 threads
// takes the whole head and waits for all its lanes to have read a token before any writes that
// token's out row: blocks never share a row.
#include "common/fail.h"
#include "gpu/decode/recurrent_token.cuh"

namespace flashkda::gpu {
namespace {
using namespace recurrent;

// Warps of a block: 1 (16 value rows, eight blocks a head) or 8 (the whole head).
template <int kWarps>
struct BlockShape {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static constexpr int kBlocksPerHead = kDim / kRows;
  static_assert(kBlocksPerHead * kRows == kDim, "the blocks of a head cover its value rows");
};

// Issues the loads of the lane's tile. A bf16 tile arrives packed (each run's two bf16 pairs as
// the bit patterns of its first two elements) and is widened by widen_tile where first used: the
// loads stay in flight while the warp prepares the first token, instead of stalling it at an
// unpack instruction.
template <StateLayout L>
__device__ __forceinline__ void load_tile(Tile& s, const void* head, bool bf16, const LanePlace& at) {
  if (bf16) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(run_ptr<L>(static_cast<const uint16_t*>(head), at.v0, at.kl, r)));
      Runs<L>::at(s, r, 0) = __uint_as_float(raw.x);
      Runs<L>::at(s, r, 1) = __uint_as_float(raw.y);
    }
  } else {
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
      set_run<L>(s, r, __ldcs(reinterpret_cast<const float4*>(run_ptr<L>(static_cast<const float*>(head), at.v0, at.kl, r))));
  }
}

// A packed bf16 tile (load_tile) to fp32, in place.
template <StateLayout L>
__device__ __forceinline__ void widen_tile(Tile& s) {
#pragma unroll
  for (int r = 0; r < kRuns; ++r)
    set_run<L>(s, r, make_uint2(__float_as_uint(Runs<L>::at(s, r, 0)), __float_as_uint(Runs<L>::at(s, r, 1))));
}

// At most 128 registers (no spills): 16 warps a multiprocessor. A decode step is
// latency-bound per block (load the tile, a chain of dependent arithmetic and shuffles, store),
// so warps in flight matter more than anything else here.
template <StateLayout L, int kWarps, bool kVector>
__global__ void __launch_bounds__(BlockShape<kWarps>::kThreads, 16 / kWarps) recurrent_kernel(const RecurrentParams p) {
  using Shape = BlockShape<kWarps>;
  const int item = blockIdx.x / Shape::kBlocksPerHead;  // (sequence, head); 32-bit: N H 2 <= INT_MAX (the plan)
  const int n = item / p.num_heads;
  const int h = item % p.num_heads;
  const LanePlace at =
      lane_place(threadIdx.x % 32, (blockIdx.x % Shape::kBlocksPerHead) * Shape::kRows + threadIdx.x / 32 * kRowsPerWarp);

  const int64_t start = p.slots.start(n);
  if (!p.slots.runs(start, p.initial_state != nullptr)) return;  // padding: nothing is written for it
  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);

  // The first token's inputs, then the tile: the token's prep runs while the tile is in flight.
  const int64_t len = eos - bos;
  TokenInputs next;
  if (len > 0) next = load_token<kVector>(p, batch_row(p, n), bos, h, at);
  const HeadGate gate = head_gate(p, h, at.lane);

  Tile s;
  bool packed = false;  // s holds a packed bf16 tile until widen_tile
  if (p.initial_state) {
    load_tile<L>(s, head_state(p.initial_state, p.initial_bf16, start, p.num_heads, h), p.initial_bf16, at);
    packed = p.initial_bf16;
  } else {
    zero_tile(s);
  }
  auto widen = [&] {
    if (packed) widen_tile<L>(s);
    packed = false;
  };

  __shared__ TokenPrep prep_of_warp[Shape::kThreads / 32];
  TokenPrep& prep = prep_of_warp[threadIdx.x / 32];
  for (int64_t t = 0; t < len; ++t) {
    if (p.checkpoints.count > 0 && t % 16 == 0) {
      widen();
      write_checkpoints<L>(p, s, n, h, t, at);
    }
    const TokenInputs x = next;
    if (t + 1 < len) next = load_token<kVector>(p, batch_row(p, n), bos + t + 1, h, at);  // in flight during this token

    float o[kRowsPerLane];
    token_step(p, s, prep, static_cast<int>(t & 1), x, gate, at, o, widen);
    if constexpr (Shape::kBlocksPerHead == 1) __syncthreads();  // every lane has read this token's row
    store_out(p, o, bos + t, h, at);
    store_token_state<L>(p, s, n, t, h, at);
  }
  widen();  // a sequence without tokens
  if (p.checkpoints.count > 0 && len % 16 == 0) write_checkpoints<L>(p, s, n, h, len, at);
  store_final_state<L>(p, s, n, start, h, at);
}

template <int kWarps>
void launch(const RecurrentParams& p, StateLayout layout, cudaStream_t stream) {
  using Shape = BlockShape<kWarps>;
  const int64_t blocks = p.seqs.num_seqs * p.num_heads * Shape::kBlocksPerHead;
  if (blocks == 0) return;
  const auto kernel = layout == StateLayout::kVK
                          ? (p.vector_loads ? recurrent_kernel<StateLayout::kVK, kWarps, true>
                                            : recurrent_kernel<StateLayout::kVK, kWarps, false>)
                          : (p.vector_loads ? recurrent_kernel<StateLayout::kKV, kWarps, true>
                                            : recurrent_kernel<StateLayout::kKV, kWarps, false>);
  kernel<<<static_cast<unsigned>(blocks), Shape::kThreads, 0, stream>>>(p);
}

}  // namespace

void launch_recurrent(const RecurrentParams& p, StateLayout layout, cudaStream_t stream) {
  if (p.out_aliases_input) launch<8>(p, layout, stream);
  else launch<1>(p, layout, stream);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    fail(ErrorCode::kCudaError, "launching the recurrent kernel: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
