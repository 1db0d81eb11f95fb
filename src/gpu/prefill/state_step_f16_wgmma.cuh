// The fp16 chunk step with its three state products on wgmma (FLASHKDA_STATE_F16_WGMMA=1): the
// arithmetic of chunk_step_f16 (state_step_f16.cuh: the same row scales, products, tests and
// rescaling), for the 4 warps of a warpgroup together, on F16WgmmaRecords:
//   [X^ | P^] = S^ [Wk | Qe]^T  m64n32k16 x 8 (A = S^ packed to fp16 from its registers)
//   S^ = D S^ + fp16(U^) Kr     m64n128k16 x 1 (the state's registers the accumulator)
// The record's Wk, Qe and Kr are read from shared memory once a warpgroup, not once a warp (the
// 8x1 block's shared-memory pipe is its limit, docs/perf-notes.md). W V and the out rows' M
// product stay on mma.sync (per warp, under the wgmmas in flight).
#pragma once

#include "gpu/prefill/state_step_f16.cuh"
#include "gpu/prefill/state_wgmma_step.cuh"  // tile_desc
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::gpu::state_pass {

template <typename OutT>
__device__ __forceinline__ void chunk_step_f16_wgmma(float (&acc)[kNTiles][4], RowScale& sc, const uint8_t* rec,
                                                     const F16LaneOffsets& o, int vbase, int lane, OutT* out_chunk,
                                                     int count, int64_t out_row_stride) {
  using Record = F16WgmmaRecord;
  float(&s)[4 * kNTiles] = reinterpret_cast<float(&)[4 * kNTiles]>(acc);  // the m64n128 accumulator's order
  const uint64_t rec_desc = tile_desc(rec);
  // k-step j's A fragment is n-tiles 2j, 2j + 1 packed, as in chunk_step_f16.
  uint32_t as[kNTiles / 2][4];
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j) {
    as[j][0] = ptx::pack_f16x2(acc[2 * j][0], acc[2 * j][1]);
    as[j][1] = ptx::pack_f16x2(acc[2 * j][2], acc[2 * j][3]);
    as[j][2] = ptx::pack_f16x2(acc[2 * j + 1][0], acc[2 * j + 1][1]);
    as[j][3] = ptx::pack_f16x2(acc[2 * j + 1][2], acc[2 * j + 1][3]);
    ptx::fence_operands(as[j]);
  }
  float xp[16];  // X^ in n-blocks 0, 1 (tokens 0..7, 8..15), P^ in 2, 3
  ptx::fence_operands(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int j = 0; j < kNTiles / 2; ++j)
    ptx::wgmma_f16<32>(xp, as[j], tile_desc(rec_desc, Record::kWkQe + Record::kKStepTile * j), j > 0);
  ptx::wgmma_commit();
  float wv[2][4];
  form_wv<Record>(rec, o.m, vbase, lane, count, wv);  // mma.sync while the wgmmas run
  ptx::wgmma_wait<0>();
  ptx::fence_operands(xp);

  float P[2][4], u[2][4], su[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1;
      P[nt][i] = xp[8 + 4 * nt + i] * sc.up[r];
      u[nt][i] = fmaf(wv[nt][i], sc.down[r], -xp[4 * nt + i]);
      su[r] += fabsf(u[nt][i]);
    }
  bool outside = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    su[r] = quad_sum(su[r]);
    outside |= (sc.bound[r] > kRescaleHigh) | (su[r] > kRescaleHigh) | ((su[r] < kRescaleLow) & (su[r] > 0.0f));
  }
  if (__any_sync(0xffffffffu, outside)) rescale_rows(acc, u, sc, su);
  sc.bound[0] += su[0];
  sc.bound[1] += su[1];

  uint32_t ua[4] = {ptx::pack_f16x2(u[0][0], u[0][1]), ptx::pack_f16x2(u[0][2], u[0][3]),
                    ptx::pack_f16x2(u[1][0], u[1][1]), ptx::pack_f16x2(u[1][2], u[1][3])};
#pragma unroll
  for (int nl = 0; nl < kNTiles; ++nl) {
    const float2 d = load_pair(rec + o.decay + 32 * nl);
    acc[nl][0] *= d.x;
    acc[nl][1] *= d.y;
    acc[nl][2] *= d.x;
    acc[nl][3] *= d.y;
  }
  ptx::fence_operands(ua);
  ptx::fence_operands(s);
  ptx::wgmma_fence();
  ptx::wgmma_f16<128>(s, ua, tile_desc(rec_desc, Record::kKr), true);
  ptx::wgmma_commit();
  finish_out_rows<Record>(P, wv, rec, o.m, vbase, lane, out_chunk, count, out_row_stride);
  ptx::wgmma_wait<0>();  // the update has read Kr: the stage may be released
  ptx::fence_operands(s);
}

}  // namespace flashkda::gpu::state_pass
