// The per-(chunk, head) record the prep kernel writes and the state-pass kernel reads.
//
// Chunk form of KDA.md with W = (I + L)^{-1} Diag(beta) (C = 16 tokens, state S [K, V]):
//   U = W (V - K~ S) = WV - Wk S           with Wk = W K~, WV = W V
//   O = Q~ S + M U   = Qe S + M WV         with Qe = Q~ - M Wk
//   S' = Diag(exp(G_C)) S + Kr^T U
// Everything but S is token-parallel, so the prep kernel computes it once per (chunk, head) and
// the sequential state pass only does the three S products. Layouts are chosen for the state
// kernel's ldmatrix/fragment reads (see state_kernel.cu); [16][128] bf16 tiles are swizzled.
#pragma once

#include <cstdint>

namespace flashkda::gpu {

constexpr int kChunk = 16;     // tokens per chunk
constexpr int kHeadDim = 128;  // K = V = 128

struct ChunkRecord {
  // [16 tokens][128 channels] bf16 tiles, 16-byte column blocks XOR-swizzled by row (see tile_offset).
  static constexpr uint32_t kWk = 0;       // W K~
  static constexpr uint32_t kQe = 4096;    // Q~ - M W K~  (scale folded in)
  static constexpr uint32_t kKrHi = 8192;  // K^ exp(G_C - G), high bf16 part
  static constexpr uint32_t kKrLo = 12288; // low part: Kr - bf16(Kr)
  static constexpr uint32_t kWV = 16384;   // W V, fp32 [128 v][16 tokens]
  static constexpr uint32_t kM = 24576;    // M, bf16 [16][16] (lower triangular incl. diagonal)
  static constexpr uint32_t kDecay = 25088;// exp(G_C), fp32 [128]
  static constexpr uint32_t kBytes = 25600;
};

// Byte offset of element (row, col) inside a swizzled [16][128] bf16 tile: 16-byte block `col/8`
// of row `row` is stored at block (col/8) ^ (row % 8), so the 8 rows an ldmatrix reads at one
// logical block hit 8 different bank groups.
__host__ __device__ __forceinline__ uint32_t tile_offset(int row, int col) {
  return static_cast<uint32_t>(row * 256 + ((((col >> 3) ^ (row & 7)) << 4) | ((col & 7) << 1)));
}

// Byte offset of the start of 16-byte block `block` (logical) of row `row`.
__host__ __device__ __forceinline__ uint32_t tile_block_offset(int row, int block) {
  return static_cast<uint32_t>(row * 256 + ((block ^ (row & 7)) << 4));
}

}  // namespace flashkda::gpu
