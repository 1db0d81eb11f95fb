// The work-item scheduler of the persistent grids, written once. The persistent state pass: block
// b starts with item b, then each block takes the next item from a counter in the workspace, so
// a block that drew short items takes more of them (the balance the hardware's block scheduler
// gives a grid of one block an item, without a block's start-up cost for every item); the kernel
// that runs before it in the stream (prep) zeroes the counter. The prep tail, whose blocks may
// leave without any item, takes every item from the counter (take()); the host zeroes it.
#pragma once

#include <cstdint>

namespace flashkda::gpu {

struct ItemScheduler {
  unsigned long long* counter;  // items taken past the first wave; zero before the grid starts

  // One thread of the stream's kernel before the persistent grid.
  __device__ __forceinline__ void reset() const { *counter = 0; }
  __device__ __forceinline__ int64_t initial_work() const { return blockIdx.x; }
  // One thread a block; the caller hands the item to the rest.
  __device__ __forceinline__ int64_t next_work() const { return gridDim.x + take(); }
  // The counter's next item, no item tied to a block (the counter-only form).
  __device__ __forceinline__ int64_t take() const { return static_cast<int64_t>(atomicAdd(counter, 1ull)); }
};

}  // namespace flashkda::gpu
