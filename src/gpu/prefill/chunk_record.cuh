// The per-(chunk, head) record the prep kernel writes and the state-pass kernel reads.
//
// Chunk form of docs/contract.md with W = (I + L)^{-1} Diag(beta) (C = 16 tokens, state S [K, V]):
//   U = W (V - K~ S) = WV - Wk S           with Wk = W K~, WV = W V
//   O = Q~ S + M U   = Qe S + M WV         with Qe = Q~ - M Wk
// V itself does not go through the record: the state kernel copies the chunk's rows of v from
// the input next to it and forms W V with the tensor cores (W split hi + lo).
//   S' = Diag(exp(G_C)) S + Kr^T U
// Everything but S is token-parallel, so the prep kernel computes it once per (chunk, head) and
// the sequential state pass only does the three S products. Layouts are chosen for the state
// kernel's fragment reads (see state_kernel.cu).
#pragma once

#include <cstdint>

#include "gpu/prefill/record_form.h"

namespace flashkda::gpu {

constexpr int kChunk = 16;     // tokens per chunk
constexpr int kHeadDim = 128;  // K = V = 128

// The [16][128] tiles are stored in the state kernel's mma B-fragment order: fragment f (an
// n-tile of 8 rows by a k-tile of 8) is 32 consecutive lane entries, lane (g = lane / 4,
// t = lane % 4) holding elements 2t and 2t + 1 of row g (the k-slot order of mma.cuh). Each
// fragment read is then one conflict-free load at a fixed per-lane offset, and the prep kernel's
// C fragments map onto the same entries, so its stores are whole 128/256-byte lines.
//   Wk  fp32 pairs [2 token halves][16 channel tiles][32 lanes]  (tf32-rounded)
//   Qe  bf16 pairs [2 token halves][16 channel tiles][32 lanes]
//   Kr  fp32 pairs [16 channel tiles][2 token halves][32 lanes]  (rows = channels, k = tokens;
//                                                                  tf32-rounded)
// Qe in bf16 halves its bytes. Wk and Kr stay tf32: X = S Wk cancels against W V when the state
// is large, and Kr enters every state update; bf16 Kr cost 3.2e-3 on a bf16 final_state with a
// large initial state and little decay, against 1.9e-3 in tf32 (tools/numerics, tf32-qk16 and
// tf32-q16; the contract's bar is 3e-3). W and M are small fp32 [16][16] tiles read as 8-byte
// pairs; W is kept whole and split hi + lo by the state kernel.
struct ChunkRecord {
  static constexpr uint32_t kWk = 0;                                  // W K~               fp32 fragments
  static constexpr uint32_t kQe = kWk + kChunk * kHeadDim * 4;         // Q~ - M W K~        bf16 fragments
  static constexpr uint32_t kKr = kQe + kChunk * kHeadDim * 2;         // (K^ e^(G_C - G))^T fp32 fragments
  static constexpr uint32_t kW = kKr + kHeadDim * kChunk * 4;          // W = (I + L)^-1 Diag(beta) [16][16], swizzle_16
  static constexpr uint32_t kM = kW + kChunk * kChunk * 4;             // M (tf32)                  [16][16], swizzle_16
  static constexpr uint32_t kDecay = kM + kChunk * kChunk * 4;         // exp(G_C)                  [128]
  static constexpr uint32_t kBytes = kDecay + kHeadDim * 4;
};
static_assert(ChunkRecord::kBytes % 128 == 0, "a multiple of 128 bytes: the stages stay aligned");
static_assert(ChunkRecord::kQe == 8192 && ChunkRecord::kBytes == 23040, "the K = V = 128 record the kernels read");

// The record of the fp16 state step (state_step_f16.cuh; docs/perf-notes.md, "fp16 as the state
// step's MMA type"): Wk, Qe and Kr as m16n8k16 B fragments (mma.cuh), one 8-byte entry a lane.
//   Wk, Qe  [2 token n-tiles nt][8 channel k-tiles j][32 lanes]: lane (g, t4) holds channels
//           16 j + 2 t4, + 1 (low word) and 16 j + 2 t4 + 8, + 9 (high word) of token 8 nt + g
//   Kr      [16 channel n-tiles nl][32 lanes]: tokens 2 t4, + 1 (low) and 2 t4 + 8, + 9 (high) of
//           channel 8 nl + g
// W, M and exp(G_C) as in ChunkRecord. fp16 holds Wk (|Wk| <= 2^15), Kr (<= 1) and Qe with
// tf32's 11 significant bits; the state's range is the step's business (a scale a row).
struct F16Record {
  static constexpr uint32_t kWk = 0;
  static constexpr uint32_t kQe = kWk + kChunk * kHeadDim * 2;
  static constexpr uint32_t kKr = kQe + kChunk * kHeadDim * 2;
  static constexpr uint32_t kW = kKr + kHeadDim * kChunk * 2;
  static constexpr uint32_t kM = kW + kChunk * kChunk * 4;
  static constexpr uint32_t kDecay = kM + kChunk * kChunk * 4;
  static constexpr uint32_t kBytes = kDecay + kHeadDim * 4;
  // Where prep's pair of an mma C fragment goes (n-tile `ntile` of 8 channels, token half r):
  // word ntile & 1 of entry (r, ntile / 2, lane), for Wk at kWk and Qe at kQe.
  __host__ __device__ static constexpr uint32_t pair(uint32_t field, int ntile, int r, int lane) {
    return field + static_cast<uint32_t>(((r * 8 + ntile / 2) * 32 + lane) * 8 + (ntile & 1) * 4);
  }
  // Channel c's 16 tokens of Kr: the 32 bytes of lanes 4 (c % 8) .. + 3 of n-tile c / 8.
  __host__ __device__ static constexpr uint32_t kr_channel(int c) {
    return kKr + static_cast<uint32_t>(((c / 8) * 32 + 4 * (c % 8)) * 8);
  }
};
static_assert(F16Record::kBytes % 128 == 0 && F16Record::kBytes == 14848, "the 14.5 KB record");

// Byte offset of (row, slot) inside one k-step tile of a WgmmaRecord field (rows x 8 slots).
__host__ __device__ constexpr uint32_t wgmma_tile_offset(int row, int slot) {
  return static_cast<uint32_t>((row / 8) * 256 + (slot / 4) * 128 + (row % 8) * 16 + (slot % 4) * 4);
}
// The slot of element e (0..7) of a k-step in a permuted tile.
__host__ __device__ constexpr int permuted_slot(int e) { return (e & 1) * 4 + (e >> 1); }

// The record of the wgmma state pass (state_wgmma_kernel.cu, FLASHKDA_STATE_WGMMA=1; experimental):
// the same matrices, each stored as wgmma B operands (ptx/wgmma.cuh), one tile per k-step of 8:
// [rows][8 slots] in the no-swizzle K-major layout (core matrices 8 rows x 16 bytes; the leading
// offset 128 bytes along the slots, the stride offset 256 along the rows). A "permuted" tile
// multiplies an A operand taken from a D fragment, whose k order puts even elements of the
// k-step in slots 0..3 and odd ones in 4..7 (mma.cuh). All fp32, tf32-rounded where the tensor
// cores read them. kTokens: the chunk's tokens (16, the pass's; 32, measured alone by
// tests/gpu/test_wgmma_step_gpu.cu: a larger chunk gives each wgmma more work a step).
template <int kTokens>
struct WgmmaRecordOf {
  static_assert(kTokens % 8 == 0 && kTokens <= 32, "whole token k-steps; 2 x 32 rows fit one wgmma's n");
  static constexpr uint32_t kTokenTile = kTokens * 32;     // a k-step tile of the chunk's token rows
  static constexpr uint32_t kPairTile = 2 * kTokenTile;    // a k-step tile of Wk's rows, then Qe's
  static constexpr uint32_t kChannelTile = kHeadDim * 32;  // a k-step tile of 128 channel rows (4096 B)
  // Wk and Qe share their A operand (S^T): one m64n(2 kTokens)k8 product a k-step reads both, so
  // each k-step's tile holds Wk's token rows then Qe's.
  // [16 k-steps][Wk kTokens t, Qe kTokens t][8 k-slots], k permuted
  static constexpr uint32_t kWkQe = 0;
  static constexpr uint32_t kKr = kWkQe + (kHeadDim / 8) * kPairTile;  // Kr [t-steps][128 k][8 t-slots], t permuted
  static constexpr uint32_t kW = kKr + (kTokens / 8) * kChannelTile;   // W  [hi, lo][t'-steps][kTokens t][8 t'-slots]
  static constexpr uint32_t kM = kW + 2 * (kTokens / 8) * kTokenTile;  // M  [t'-steps][kTokens t][8 t'-slots], permuted
  static constexpr uint32_t kDecay = kM + (kTokens / 8) * kTokenTile;  // exp(G_C) [128]
  static constexpr uint32_t kBytes = kDecay + kHeadDim * 4;

  // Where each element goes (the prep kernel's stores; tests/gpu/test_wgmma_record.cu checks
  // them against the order the wgmma pass reads): token t, key channel k, token t' of W and M.
  __host__ __device__ static constexpr uint32_t wk(int t, int k) {
    return kWkQe + (k / 8) * kPairTile + wgmma_tile_offset(t, permuted_slot(k % 8));
  }
  __host__ __device__ static constexpr uint32_t qe(int t, int k) {
    return kWkQe + (k / 8) * kPairTile + wgmma_tile_offset(kTokens + t, permuted_slot(k % 8));
  }
  __host__ __device__ static constexpr uint32_t kr(int t, int k) {
    return kKr + (t / 8) * kChannelTile + wgmma_tile_offset(k, permuted_slot(t % 8));
  }
  __host__ __device__ static constexpr uint32_t w(int part, int t, int tp) {  // part 0: hi, 1: lo
    return kW + part * (kTokens / 8) * kTokenTile + (tp / 8) * kTokenTile + wgmma_tile_offset(t, tp % 8);
  }
  __host__ __device__ static constexpr uint32_t m(int t, int tp) {
    return kM + (tp / 8) * kTokenTile + wgmma_tile_offset(t, permuted_slot(tp % 8));
  }
  // The pair a lane holds in an mma C fragment of n-tile n, token half r: token g + 8 r (g = lane
  // / 4), channels 8 n + 2 t4 and + 1 (t4 = lane % 4). Where wk() and qe() put the even element,
  // in shifts and adds (the prep kernel's stores: the general forms' signed divisions took ~130
  // instructions there); the odd one is kOddSlot bytes on (slot t4 + 4 of the permuted tile).
  static constexpr uint32_t kOddSlot = 128;
  __host__ __device__ static constexpr uint32_t wk_pair(int n, int r, int lane) {
    return kWkQe + n * kPairTile + r * 256 + (lane >> 2) * 16 + (lane & 3) * 4;
  }
  __host__ __device__ static constexpr uint32_t qe_pair(int n, int r, int lane) {
    return wk_pair(n, r, lane) + (kTokens / 8) * 256;
  }
  // kr(8 ts, c): channel c's row of token step ts, from slot 0 (c >= 0), in shifts and adds.
  __host__ __device__ static constexpr uint32_t kr_row(int ts, int c) {
    return kKr + ts * kChannelTile + (c >> 3) * 256 + (c & 7) * 16;
  }
};
// wk_pair, qe_pair and kr_row against wk, qe and kr for every n-tile, token half, lane and channel.
template <int kTokens>
constexpr bool pair_offsets_agree() {
  using R = WgmmaRecordOf<kTokens>;
  for (int n = 0; n < kHeadDim / 8; ++n)
    for (int r = 0; r < kTokens / 8; ++r)
      for (int lane = 0; lane < 32; ++lane) {
        const int t = lane / 4 + 8 * r, k = 8 * n + 2 * (lane % 4);
        if (R::wk_pair(n, r, lane) != R::wk(t, k) || R::wk_pair(n, r, lane) + R::kOddSlot != R::wk(t, k + 1) ||
            R::qe_pair(n, r, lane) != R::qe(t, k) || R::qe_pair(n, r, lane) + R::kOddSlot != R::qe(t, k + 1))
          return false;
      }
  for (int ts = 0; ts < kTokens / 8; ++ts)
    for (int c = 0; c < kHeadDim; ++c)
      if (R::kr_row(ts, c) != R::kr(8 * ts, c)) return false;
  return true;
}
static_assert(pair_offsets_agree<16>() && pair_offsets_agree<32>(), "the lane offsets are wk's, qe's and kr's");
using WgmmaRecord = WgmmaRecordOf<kChunk>;
static_assert(WgmmaRecord::kBytes % 128 == 0, "a multiple of 128 bytes: the stages stay aligned");

// The record type of each form, and its size.
template <RecordForm F>
struct RecordOf {
  using type = ChunkRecord;
};
template <>
struct RecordOf<RecordForm::kWgmma> {
  using type = WgmmaRecord;
};
template <>
struct RecordOf<RecordForm::kF16> {
  using type = F16Record;
};
__host__ __device__ constexpr uint32_t record_bytes(RecordForm f) {
  return f == RecordForm::kWgmma ? WgmmaRecord::kBytes : f == RecordForm::kF16 ? F16Record::kBytes : ChunkRecord::kBytes;
}
static_assert(WgmmaRecord::kKr == 16384 && WgmmaRecord::kBytes == 28160, "the K = V = 128 record");
static_assert(WgmmaRecordOf<32>::kBytes % 128 == 0 && WgmmaRecordOf<32>::kBytes == 61952, "the 32-token record");

// Byte offset of lane `lane`'s entry of fragment `frag` in a fragment-ordered tile whose
// entries are `entry_bytes` wide (8: fp32 pair, 4: bf16 pair).
__host__ __device__ __forceinline__ uint32_t fragment_entry(int frag, int lane, int entry_bytes) {
  return static_cast<uint32_t>((frag * 32 + lane) * entry_bytes);
}

// Element index of (row, col) in a swizzled [rows][16] fp32 tile: halves swapped on rows 2, 3 mod 4.
__host__ __device__ __forceinline__ int swizzle_16(int row, int col) { return row * 16 + (col ^ (((row >> 1) & 1) << 3)); }

}  // namespace flashkda::gpu
