// Sequence bounds and chunk slots on the device.
//
// Sequence n, tokens [bos, eos), owns record slots [bos/16 + n, bos/16 + n + ceil(len/16)).
// Slots of consecutive sequences never overlap (floor(bos/16) + n grows by at least one per
// sequence), so no prefix sum is needed: there are at most floor(total/16) + N + 1 slots.
// Bounds are clamped to [0, total_tokens] with eos >= bos, so invalid cu_seqlens that were not
// checked on the host can never cause an out-of-bounds access.
#pragma once

#include <cstdint>

#include "gpu/prefill/chunk_record.cuh"

namespace flashkda::gpu {

struct SequenceTable {
  const void* cu_seqlens;  // [N + 1] int32 or int64, or nullptr: sequence n = [n*T, (n+1)*T)
  bool cu_seqlens_i32;
  int64_t fixed_len;       // T when cu_seqlens is null
  int64_t num_seqs;        // N
  int64_t total_tokens;

  __device__ __forceinline__ int64_t offset(int64_t n) const {
    int64_t x;
    if (!cu_seqlens) x = n * fixed_len;
    else if (cu_seqlens_i32) x = __ldg(static_cast<const int32_t*>(cu_seqlens) + n);
    else x = __ldg(static_cast<const int64_t*>(cu_seqlens) + n);
    return x < 0 ? 0 : (x > total_tokens ? total_tokens : x);
  }

  __device__ __forceinline__ void bounds(int64_t n, int64_t& bos, int64_t& eos) const {
    bos = offset(n);
    eos = offset(n + 1);
    if (eos < bos) eos = bos;
  }

  __device__ __forceinline__ int64_t first_slot(int64_t n, int64_t bos) const { return bos / kChunk + n; }

  // order[r] = the sequence of rank r, longest first (ties by index), computed by the calling
  // block: each thread ranks its sequences by counting the ones before them, O(N^2 / threads),
  // so callers keep N small (kMaxOrderedSeqs).
  __device__ void order_by_length(int* order) const {
    for (int64_t n = threadIdx.x; n < num_seqs; n += blockDim.x) {
      const int64_t len = offset(n + 1) - offset(n);
      int64_t rank = 0;
      for (int64_t m = 0; m < num_seqs; ++m) {
        const int64_t other = offset(m + 1) - offset(m);
        rank += other > len || (other == len && m < n);
      }
      order[rank] = static_cast<int>(n);
    }
  }
};

// Sequences the persistent state pass takes longest first: with more (sequence, head) items than
// multiprocessors, a long sequence taken last runs alone at the end. Above this count the ranking
// (in one block of the prep kernel) would cost more than it saves, and the order stays 0, 1, ...
constexpr int64_t kMaxOrderedSeqs = 512;

inline int64_t num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / kChunk + num_seqs + 1;
}

}  // namespace flashkda::gpu
