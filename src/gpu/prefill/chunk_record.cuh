// The per-(chunk, head) record the prep kernel writes and the state-pass kernel reads.
//
// Chunk form of KDA.md with W = (I + L)^{-1} Diag(beta) (C = 16 tokens, state S [K, V]):
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

namespace flashkda::gpu {

constexpr int kChunk = 16;     // tokens per chunk
constexpr int kHeadDim = 128;  // K = V = 128

// All tiles fp32; the ones the tensor cores read (Wk, Qe, Kr, M) rounded to tf32. The state
// kernel reads every tile as 8-byte pairs (two adjacent elements of one row); the XOR swizzles
// below make each half-warp's pairs hit 32 different banks.
struct ChunkRecord {
  static constexpr uint32_t kWk = 0;         // W K~               [16 tokens][128 channels], swizzle_128
  static constexpr uint32_t kQe = 8192;      // Q~ - M W K~        [16 tokens][128 channels], swizzle_128
  static constexpr uint32_t kKr = 16384;     // (K^ e^(G_C - G))^T [128 channels][16 tokens], swizzle_16
  static constexpr uint32_t kWHi = 24576;    // W = (I + L)^-1 Diag(beta), tf32 part  [16][16], swizzle_16
  static constexpr uint32_t kWLo = 25600;    // W - tf32(W), tf32 part                [16][16], swizzle_16
  static constexpr uint32_t kM = 26624;      // M                  [16][16],                  swizzle_16
  static constexpr uint32_t kDecay = 27648;  // exp(G_C)           [128]
  static constexpr uint32_t kBytes = 28160;
};

// Element index of (row, col) in a swizzled [rows][128] fp32 tile: 8-column groups XOR (row % 4).
__host__ __device__ __forceinline__ int swizzle_128(int row, int col) { return row * 128 + (col ^ ((row & 3) << 3)); }

// Element index of (row, col) in a swizzled [rows][16] fp32 tile: halves swapped on rows 2, 3 mod 4.
__host__ __device__ __forceinline__ int swizzle_16(int row, int col) { return row * 16 + (col ^ (((row >> 1) & 1) << 3)); }

}  // namespace flashkda::gpu
