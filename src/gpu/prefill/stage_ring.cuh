// The stage ring of the state passes, written once: kStages shared-memory stages between one
// producer thread (bulk copies that complete on full[s]) and the consumer threads (each releases
// a stage on empty[s] when its reads are done). The mbarrier phase bit lives in Cursor only.
#pragma once

#include <cstdint>

#include "gpu/ptx/bulk_copy.cuh"

namespace flashkda::gpu::state_pass {

// A view over two __shared__ arrays of kStages barriers that the kernel declares itself: the
// same barriers as members of one __shared__ struct moved ptxas's register allocation of the
// 8x1 state kernel (159 -> 164 registers, its loads bunched at the step's start) and cost P1 4%
// on the H200 (1.237 against 1.191 ms, same session).
template <int kStages>
struct StageRing {
  static_assert(kStages >= 1, "kStages = 1: a handover, one thing at a time");
  uint64_t* full;   // [kStages] one arrival (the producer's expect_tx) and the copies' bytes
  uint64_t* empty;  // [kStages] one arrival a consumer thread

  // A position in the ring: the stage and the parity of its current lap. Consumers wait on
  // full[stage] for `phase`; the producer waits on empty[stage] for `phase ^ 1`, the release of
  // the previous lap. A barrier fresh from init counts that phase as complete (its current phase
  // is 0), so the producer's first lap never waits and needs no counter of its own (the
  // per-item kernel skips those waits all the same: see state_kernel.cu).
  struct Cursor {
    int stage = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    // The position of fill number n, for a producer that refills behind the consumers' cursor.
    static __device__ __forceinline__ Cursor of_fill(int n) { return {n % kStages, static_cast<uint32_t>(n / kStages) & 1u}; }
  };

  // One thread; its fence also publishes any barrier it initialised before (to the copy engine),
  // and the caller's __syncthreads to the block. A stage is full after `producer_arrivals` arrivals
  // (one thread's expect_tx, or every thread of a producer that writes the stage itself) and the
  // bytes expected of its copies.
  __device__ __forceinline__ void init(uint32_t consumer_threads, uint32_t producer_arrivals = 1) const {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], producer_arrivals);
      ptx::mbarrier_init(&empty[s], consumer_threads);
    }
    ptx::fence_mbarrier_init();
  }

  // Producer: wait until every consumer has released the stage, then fill it on full_barrier.
  __device__ __forceinline__ void wait_empty(const Cursor& at) const { ptx::mbarrier_wait_parity(&empty[at.stage], at.phase ^ 1); }
  __device__ __forceinline__ uint64_t* full_barrier(const Cursor& at) const { return &full[at.stage]; }
  // Consumers: wait for the stage's copies, read it, release it.
  __device__ __forceinline__ void wait_full(const Cursor& at) const { ptx::mbarrier_wait_parity(&full[at.stage], at.phase); }
  __device__ __forceinline__ void release(const Cursor& at) const { ptx::mbarrier_arrive(&empty[at.stage]); }
};

}  // namespace flashkda::gpu::state_pass
