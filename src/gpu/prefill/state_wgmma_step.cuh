// The chunk step of the wgmma state pass (state_wgmma_kernel.cu), on one warpgroup's 64 value
// rows: shared by the kernel and tests/gpu/test_wgmma_step_gpu.cu, which runs it alone.
//   group 1: [X^T | O^T] = S^T [Wk | Qe]^T (m64n32k8 x 16: one product a k-step for both)
//   group 2: WV^T = V^T (W_hi + W_lo)^T (m64n16k8 x 4), issued while group 1 runs
//   U^T = tf32(WV^T - X^T); S^T *= Diag(exp(G_C)) once group 1 has read S^T
//   groups 3, 4: O^T += WV^T M^T (x 2), S^T += U^T Kr (m64n128k8 x 2)
// What ptxas needs to keep the wgmmas pipelined (found with -Xptxas -v, see docs/perf-notes.md):
// each accumulator's products in a group of their own; the A operand taken from WV^T's
// accumulator copied into registers of its own (one add); S^T's A fragments left unpinned; no
// accumulator that is a view into another or a copy of one (O^T's M product accumulates apart).
#pragma once

#include <cstdint>

#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/state_step.cuh"  // store_out_rows, v_operand
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/mma.cuh"
#include "gpu/ptx/movmatrix.cuh"
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::gpu::state_pass {

// The record's tiles: the descriptor of the stage's first byte, advanced to each tile.
__device__ __forceinline__ uint64_t tile_desc(const uint8_t* tile) { return ptx::smem_matrix_desc(tile, 128, 256); }
__device__ __forceinline__ uint64_t tile_desc(uint64_t stage_desc, uint32_t offset) {
  return ptx::smem_matrix_desc_advance(stage_desc, offset);
}

// A fragment for k-step j of an m64nN accumulator: its n-block j is an mma C fragment, which
// tf32_a_from_c (mma.cuh) makes an A fragment with k permuted.
template <int R>
__device__ __forceinline__ void a_from_d(const float (&d)[R], int j, uint32_t (&a)[4]) {
  ptx::tf32_a_from_c(*reinterpret_cast<const float(*)[4]>(&d[4 * j]), a);
}

// One chunk on this warpgroup's 64 value rows. s: S^T as the m64n128 accumulator (s[4 j + i] =
// acc[j][i] of state_step.cuh); rec: the stage (WgmmaRecordOf<kTokens>, then the chunk's v rows);
// out_chunk: the chunk's first out row of the head, bf16 (OutT uint16_t) or the split pass's fp32
// partial rows (float). kTokens: the chunk's tokens (16: the pass; 32:
// tests/gpu/test_wgmma_step_gpu.cu measures it alone).
template <int kTokens = kChunk, typename OutT>
__device__ __forceinline__ void wgmma_chunk_step(float (&s)[64], const uint8_t* rec, int vbase, int lane,
                                                 OutT* out_chunk, int count, int64_t out_row_stride) {
  using Record = WgmmaRecordOf<kTokens>;
  constexpr int kSteps = kTokens / 8;  // token k-steps; n-blocks of 8 tokens
  constexpr int kHalf = kTokens / 2;   // a lane's entries of an m64n(kTokens) accumulator
  const int g = lane >> 2, t4 = lane & 3;
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(rec + Record::kBytes);  // [kTokens][kVRowStride]
  const uint64_t rec_desc = tile_desc(rec);
  // xo: X^T in n-blocks 0 .. kSteps - 1 (the tokens), O^T in the next kSteps
  float xo[kTokens] = {}, wv[kHalf] = {};
  uint32_t as[16][4], av[kSteps][4];  // S^T's A fragments by k-step; V^T's: (v row, token 8 st + t4 (+4))
#pragma unroll
  for (int st = 0; st < 16; ++st) a_from_d(s, st, as[st]);
#pragma unroll
  for (int st = 0; st < kSteps; ++st)
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // tokens past the sequence end read as 0 (the tile may hold the next one's)
      const int tok = 8 * st + t4 + 4 * half;
      const bool live = tok < count;
      av[st][2 * half] = v_operand(v_rows, tok, vbase + g, live);
      av[st][2 * half + 1] = v_operand(v_rows, tok, vbase + g + 8, live);
    }
  // (S^T's A fragments are left unpinned: pinned, ptxas serializes the wgmmas here, C7511.)
#pragma unroll
  for (int st = 0; st < kSteps; ++st) ptx::fence_operands(av[st]);
  ptx::fence_operands(xo);
  ptx::fence_operands(wv);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < 16; ++st)
    ptx::wgmma_tf32<2 * kTokens>(xo, as[st], tile_desc(rec_desc, Record::kWkQe + Record::kPairTile * st), st > 0);
  ptx::wgmma_commit();
  ptx::fence_operands(wv);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    ptx::wgmma_tf32<kTokens>(wv, av[st], tile_desc(rec_desc, Record::w(0, 0, 8 * st)), st > 0);
    ptx::wgmma_tf32<kTokens>(wv, av[st], tile_desc(rec_desc, Record::w(1, 0, 8 * st)), true);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();  // X, O (which read S^T) and WV done
  ptx::fence_operands(xo);
  ptx::fence_operands(wv);
  ptx::fence_operands(s);

  float u[kHalf];
#pragma unroll
  for (int i = 0; i < kHalf; ++i) u[i] = ptx::tf32_operand(wv[i] - xo[i]);  // U^T, rounded as the 8x1 step's
  uint32_t aw[kSteps][4], au[kSteps][4];
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    a_from_d(wv, st, aw[st]);
    a_from_d(u, st, au[st]);
#pragma unroll
    for (int e = 0; e < 4; ++e) aw[st][e] += 0x1000u;  // registers of their own (wgmma.cuh)
    ptx::fence_operands(aw[st]);
    ptx::fence_operands(au[st]);
  }
  const float* decay = reinterpret_cast<const float*>(rec + Record::kDecay);
#pragma unroll
  for (int j = 0; j < 16; ++j) {  // S^T Diag(exp(G_C)): columns 8 j + 2 t4 (+1)
    const float2 d = *reinterpret_cast<const float2*>(decay + 8 * j + 2 * t4);
    s[4 * j] *= d.x, s[4 * j + 1] *= d.y, s[4 * j + 2] *= d.x, s[4 * j + 3] *= d.y;
  }
  // WV^T M^T into a fresh accumulator, added to O^T afterwards (accumulating onto xo's O^T half,
  // or a copy of it, serializes the wgmmas: C7511).
  float o[kHalf] = {};
  ptx::fence_operands(s);
  ptx::fence_operands(o);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < kSteps; ++st) ptx::wgmma_tf32<kTokens>(o, aw[st], tile_desc(rec_desc, Record::kM + Record::kTokenTile * st), st > 0);
  ptx::wgmma_commit();
  ptx::fence_operands(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < kSteps; ++st) ptx::wgmma_tf32<128>(s, au[st], tile_desc(rec_desc, Record::kKr + Record::kChannelTile * st), true);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::fence_operands(s);
  ptx::fence_operands(o);
#pragma unroll
  for (int i = 0; i < kHalf; ++i) o[i] += xo[kHalf + i];  // O^T = S^T Qe^T + WV^T M^T

  // O^T: this warp's 16 value rows of the m64n(kTokens) accumulator, kSteps C fragments
  store_out_rows(reinterpret_cast<const float(&)[kSteps][4]>(o), vbase, lane, out_chunk, count, out_row_stride);
}

}  // namespace flashkda::gpu::state_pass
