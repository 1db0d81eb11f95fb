// The chunks a prep tail writes (PrepTail in kernels.h): a leaf header, so that host code (the
// plan's tests) can check the geometry without the kernels' headers.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

namespace flashkda::gpu {

// Which chunks a prep tail writes, on one sequence (N = 1: slot c holds chunk c): the last
// `per_segment` chunks of each of `segments` segments of `segment_chunks` chunks (the last segment
// may be shorter, as StateSplit::segment_chunks cuts them): the split pass's segments, or the
// whole sequence as one segment (the 8x1 per-item pass). The prep grid writes the other chunks.
// Counts in int: a sequence has fewer than 2^27 chunks (the plan's token limit).
struct TailChunks {
  int chunks = 0;          // the sequence's
  int segment_chunks = 0;  // a segment's
  int per_segment = 0;     // tail chunks at the end of each segment; 0: no tail
  int segments = 1;

  __host__ __device__ int segment_end(int s) const {
    const int end = (s + 1) * segment_chunks;
    return end < chunks ? end : chunks;
  }
  // Whether chunk c's records come from the tail.
  __host__ __device__ bool holds(int c) const {
    return per_segment > 0 && c >= segment_end(c / segment_chunks) - per_segment;
  }
  __host__ __device__ int count() const { return segments * per_segment; }
  // The tail's k-th chunk (k < count()): the first tail chunk of every segment, then the second
  // of every segment, ...: the order in which runs stepping side by side need them.
  __host__ __device__ int tail_chunk(int k) const { return segment_end(k % segments) - per_segment + k / segments; }
  // The prep grid's m-th chunk (m < chunks - count()): each segment's chunks before its tail.
  __host__ __device__ int head_chunk(int m) const {
    if (segments == 1) return m;  // the 8x1 pass's one segment: no division (~25 instructions a block)
    const int head = segment_chunks - per_segment;
    const int s = m / head < segments - 1 ? m / head : segments - 1;
    return s * segment_chunks + (m - s * head);
  }
};

}  // namespace flashkda::gpu
