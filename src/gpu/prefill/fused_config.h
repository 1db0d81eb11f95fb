// The fused chunk-64 prefill (fused_kernel.cu): one block a (sequence, head) that builds each
// chunk's operands in shared memory and runs the state chain on them, so that nothing but q, k,
// v, g, beta, the states and out crosses device memory. Its layouts, derived here once.
//
// Roles: warpgroup 0 prepares chunk c + 1 (gate, norms, the blocked L and M, the inverse, W Kt)
// while warpgroups 1 and 2 run chunk c's step on wgmma, each owning 64 value rows of S^T.
// Numerics (tools/numerics/chunk64_precision.py, variant f16-scaled-vscaled): fp16 tensor-core
// operands with fp32 accumulation, the state in fp32 registers with a power-of-two scale per value
// row (V enters in that scale too), the diagonal 16-token blocks of L and M in tf32.
#pragma once

#include <cstdint>

namespace flashkda::gpu::fused {

constexpr int kC = 64;        // tokens a chunk (the chain's step)
constexpr int kBlock = 16;    // tokens a block of L and M (a prep warp's rows)
constexpr int kBlocks = kC / kBlock;
constexpr int kD = 128;       // K = V
constexpr int kPrepThreads = 128, kMathThreads = 256, kThreads = kPrepThreads + kMathThreads;
constexpr int kMathRows = kD / (kMathThreads / 128);  // value rows a math warpgroup owns
static_assert(kBlocks == kPrepThreads / 32, "a prep warp a 16-token block");
static_assert(kMathRows == 64, "a math warpgroup is one m64 wgmma tile of value rows");

// Byte offset of element (r, c) of an fp16 [rows][cols] wgmma operand tile, K-major (c along K)
// without swizzle: 8 x 8 core matrices of 128 contiguous bytes, K-adjacent ones 128 bytes apart
// (the descriptor's leading offset), row-adjacent groups cols * 16 bytes apart (its stride).
__host__ __device__ constexpr uint32_t tile_offset(int r, int c, int cols) {
  return static_cast<uint32_t>(((r / 8) * (cols / 8) + c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2);
}
__host__ __device__ constexpr uint32_t tile_stride_bytes(int cols) { return static_cast<uint32_t>(cols) * 16; }

// Byte offset of element (token, column) of a [64 tokens][128] bf16 tile loaded by the copy engine
// as two [64][64] boxes with the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)).
__host__ __device__ constexpr uint32_t swizzled_offset(int tok, int col) {
  return static_cast<uint32_t>((col / 64) * (kC * 128) + tok * 128 + (((col % 64) / 8) ^ (tok % 8)) * 16 + (col % 8) * 2);
}
constexpr uint32_t kSwizzledTileBytes = kC * kD * 2;
constexpr uint32_t kBoxBytes = kSwizzledTileBytes / 2;

// The input stage: q, k, g of the chunk prep works on (swizzled tiles). Prep overwrites each
// element in place with its fp16 products (q -> scale q^ e^(G - R_b), k -> k^ e^(G - R_b),
// g -> k^ e^(T_b - G): block-relative, all <= 1), then reuses the k tile for the blocks of the
// inverse X = (I + L)^-1 (fp32 16 x 16, lower triangle of 4 x 4 blocks, lower_block), beside
// the blocks of L in a region of their own.
constexpr uint32_t kInQ = 0, kInK = kInQ + kSwizzledTileBytes, kInG = kInK + kSwizzledTileBytes;
constexpr uint32_t kInBytes = 3 * kSwizzledTileBytes;
constexpr uint32_t kBlockTileBytes = kBlock * kBlock * 4;
__host__ __device__ constexpr uint32_t lower_block(int a, int b) { return static_cast<uint32_t>(a * (a + 1) / 2 + b) * kBlockTileBytes; }
static_assert(lower_block(kBlocks - 1, kBlocks - 1) + kBlockTileBytes <= kSwizzledTileBytes, "L or X blocks fit a tile");

// An operand stage (prep -> math), two of them: the chunk's fp16 wgmma B tiles, V as loaded, the decay.
struct OpStage {
  static constexpr uint32_t kWk = 0;                                    // W Kt [64 tokens][128 channels]
  static constexpr uint32_t kQt = kWk + kC * kD * 2;                     // scale q^ e^G [64][128]
  static constexpr uint32_t kKrT = kQt + kC * kD * 2;                    // (k^ e^(G_C - G))^T [128][64]; Kt^T first
  static constexpr uint32_t kM = kKrT + kC * kD * 2;                     // M [64 i][64 j]
  static constexpr uint32_t kW = kM + kC * kC * 2;                       // W = (I + L)^-1 Diag(beta) [64 i][64 j]
  static constexpr uint32_t kV = kW + kC * kC * 2;                       // V, swizzled; then out rows
  static constexpr uint32_t kDecay = kV + kSwizzledTileBytes;            // exp(G_C) [128] fp32
  static constexpr uint32_t kBytes = kDecay + 1024;
};
static_assert(OpStage::kV % 1024 == 0 && OpStage::kBytes % 1024 == 0, "copy-engine boxes 1024-byte aligned");
constexpr int kOpStages = 2;

// Small per-item and per-chunk arrays after the stages.
struct Small {
  static constexpr uint32_t kDtBias = 0;                   // [128] fp32, the head's gate bias
  static constexpr uint32_t kBeta = kDtBias + kD * 4;      // [64] sigmoid(beta), 0 past the chunk's tokens
  static constexpr uint32_t kTotals = kBeta + kC * 4;      // [4 blocks][128] sum of a over each block
  // Per channel, from the block sums T_b (log2; R_b = T_0 + .. + T_(b-1), G_C = R_4), once a chunk:
  static constexpr uint32_t kER = kTotals + kBlocks * kD * 4;    // [4][128] e^R_b: Qt, Kt of block b
  static constexpr uint32_t kEKr = kER + kBlocks * kD * 4;       // [4][128] e^(G_C - R_(b+1)): Kr of block b
  // [3][128] e^(R_b - R_(j+1)) for (b, j) = (2, 0), (3, 1), (3, 0), over the first rows of the block
  // sums, which each channel's thread reads before it writes them.
  static constexpr uint32_t kEGap = kTotals;
  static constexpr uint32_t kBarriers = kEKr + kBlocks * kD * 4;  // in_full, full[2], empty[2]
  static constexpr uint32_t kBytes = kBarriers + 8 * 8;
};

constexpr uint32_t kLBlocksBytes = lower_block(kBlocks, 0);  // L's lower blocks, fp32, beta folded

constexpr uint32_t kSmemIn = 0;
constexpr uint32_t kSmemOp = kSmemIn + kInBytes;
constexpr uint32_t kSmemL = kSmemOp + kOpStages * OpStage::kBytes;
constexpr uint32_t kSmemSmall = kSmemL + kLBlocksBytes;
constexpr uint32_t kSmemBytes = kSmemSmall + Small::kBytes;
static_assert(kSmemBytes <= 227 * 1024, "fits one block a multiprocessor");

}  // namespace flashkda::gpu::fused
