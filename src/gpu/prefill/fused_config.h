// The fused chunk-64 prefill (fused_kernel.cu): one block a (sequence, head) that builds each
// chunk's operands in shared memory and runs the state chain on them, so that nothing but q, k,
// v, g, beta, the states and out crosses device memory. Its layouts, derived here once.
//
// Roles: all twelve warps prepare each chunk (gate, norms, the blocked L and M, the inverse),
// the work dealt over them; warpgroups 1 and 2 then run the chunk's step on wgmma, each owning 64
// value rows of S^T, while warpgroup 0 (the prep warpgroup) starts the next chunk: its norms and
// the first channel part of its elementwise pass. One operand stage suffices: nothing writes it
// while the step reads it. q, k, g and v come in two input stages (the copy engine).
// Numerics (tools/numerics/chunk64_precision.py, variant f16-scaled-vscaled): fp16 tensor-core
// operands with fp32 accumulation, the state in fp32 registers with a power-of-two scale per value
// row (V enters in that scale too), the diagonal 16-token blocks of L and M in tf32 (operands
// truncated, not rounded: 1.87e-3 at worst in the model against 1.73e-3).
#pragma once

#include <cstdint>

namespace flashkda::gpu::fused {

constexpr int kC = 64;        // tokens a chunk (the chain's step)
constexpr int kBlock = 16;    // tokens a block of L and M
constexpr int kBlocks = kC / kBlock;
constexpr int kD = 128;       // K = V
constexpr int kPrepThreads = 128, kMathThreads = 256, kThreads = kPrepThreads + kMathThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMathRows = kD / (kMathThreads / 128);  // value rows a math warpgroup owns
// The elementwise pass: warp w takes token block w % kBlocks and channel part w / kBlocks (part 0:
// the prep warpgroup), a part a range of channel groups of 8 (FusedParams::split).
constexpr int kParts = kWarps / kBlocks;
constexpr int kChannelGroups = kD / 8;
static_assert(kParts * kBlocks == kWarps && kParts == 3, "three channel parts of four token blocks");
// The split FusedParams::split may take: three parts, none empty.
constexpr bool valid_split(int a, int b) { return 0 < a && a < b && b < kChannelGroups; }
static_assert(kPrepThreads / 32 == kBlocks, "a prep warp a token block (norms, the inverse)");
static_assert(kMathRows == 64, "a math warpgroup is one m64 wgmma tile of value rows");

// Byte offset of element (r, c) of an fp16 [rows][cols] wgmma operand tile, K-major (c along K)
// without swizzle: 8 x 8 core matrices of 128 contiguous bytes, K-adjacent ones 128 bytes apart
// (the descriptor's leading offset), row-adjacent groups cols * 16 bytes apart (its stride).
// (Unsigned arithmetic: indices are never negative, and signed / and % cost the kernel fix-ups.)
__host__ __device__ constexpr uint32_t tile_offset(uint32_t r, uint32_t c, uint32_t cols) {
  return ((r / 8) * (cols / 8) + c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2;
}
__host__ __device__ constexpr uint32_t tile_stride_bytes(int cols) { return static_cast<uint32_t>(cols) * 16; }

// Byte offset of element (token, column) of a [64 tokens][128] bf16 tile loaded by the copy engine
// as two [64][64] boxes with the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)).
__host__ __device__ constexpr uint32_t swizzled_offset(uint32_t tok, uint32_t col) {
  return (col / 64) * (kC * 128) + tok * 128 + (((col % 64) / 8) ^ (tok % 8)) * 16 + (col % 8) * 2;
}
constexpr uint32_t kSwizzledTileBytes = kC * kD * 2;
constexpr uint32_t kBoxBytes = kSwizzledTileBytes / 2;

// An input stage: q, k, g, v of one chunk (swizzled tiles), two stages. Prep overwrites q, k, g
// in place with its fp16 products (q -> scale q^ e^(G - R_b), k -> k^ e^(G - R_b), g -> k^ e^(T_b - G):
// block-relative, all <= 1), then reuses the k tile for the off-diagonal blocks of the inverse
// X = (I + L)^-1 (fp32 16 x 16, lower_block); the step reads V and writes the out rows over it.
// q, k, g and v complete on barriers of their own: q, k, g are free once the chunk's prep is done,
// v only after its step.
constexpr uint32_t kInQ = 0, kInK = kInQ + kSwizzledTileBytes, kInG = kInK + kSwizzledTileBytes;
constexpr uint32_t kInV = kInG + kSwizzledTileBytes;
constexpr uint32_t kInQkgBytes = 3 * kSwizzledTileBytes;
constexpr uint32_t kInBytes = 4 * kSwizzledTileBytes;
constexpr int kInStages = 2;
// An fp32 16 x 16 block of L, X or Z: rows kBlockStride floats apart. 20, not 16: a C or A fragment's
// rows g = 0 .. 7 then start in eight different bank groups (16 put rows g and g + 2 on the same
// banks: 4-way conflicts on every fragment load and store of the inverse's levels).
constexpr int kBlockStride = kBlock + 4;
constexpr uint32_t kBlockTileBytes = kBlock * kBlockStride * 4;
__host__ __device__ constexpr uint32_t lower_block(int a, int b) { return static_cast<uint32_t>(a * (a + 1) / 2 + b) * kBlockTileBytes; }
static_assert(lower_block(kBlocks - 1, kBlocks - 1) + kBlockTileBytes <= kSwizzledTileBytes, "L or X blocks fit a tile");

// The operand stage (prep -> step): the chunk's fp16 wgmma B tiles. M is last, so that Kr^T after
// the stage continues its rows at the same stride: one [192][64] B tile, the step's M U and
// the state's update in one m64n192 wgmma a k-step (both have A = U^T).
struct OpStage {
  static constexpr uint32_t kKt = 0;                                    // k^ e^G [64 tokens][128 channels]
  static constexpr uint32_t kQt = kKt + kC * kD * 2;                     // scale q^ e^G [64][128]
  static constexpr uint32_t kW = kQt + kC * kD * 2;                      // W = (I + L)^-1 Diag(beta) [64 i][64 j]
  static constexpr uint32_t kM = kW + kC * kC * 2;                       // M [64 i][64 j]
  static constexpr uint32_t kBytes = kM + kC * kC * 2;
};
static_assert(OpStage::kBytes % 1024 == 0, "the regions after it stay 1024-byte aligned");

// Kr^T = (k^ e^(G_C - G))^T [128][64] fp16, read by the step; before prep writes it, the partial
// diagonal products of channel parts 1 and 2 (fp32 C fragments: [part - 1][block][L n0, L n1,
// M n0, M n1][lane] float4), which part 0 adds to its own in a fixed order (bit-identical reruns).
constexpr uint32_t kKrTBytes = kC * kD * 2;
constexpr uint32_t kPartialBytes = (kParts - 1) * kBlocks * 4 * 32 * 16;
static_assert(kPartialBytes <= kKrTBytes, "the partials fit Kr^T's place");

// Small per-item and per-chunk arrays after the stages.
struct Small {
  static constexpr uint32_t kDtBias = 0;                   // [128] fp32, the head's gate bias times -exp(A_log) log2(e)
  static constexpr uint32_t kBeta = kDtBias + kD * 4;      // [64] sigmoid(beta), 0 past the chunk's tokens
  static constexpr uint32_t kRq = kBeta + kC * 4;          // [64] scale / ||q||
  static constexpr uint32_t kRk = kRq + kC * 4;            // [64] 1 / ||k||
  static constexpr uint32_t kTotals = kRk + kC * 4;        // [4 blocks][128] sum of a over each block
  // Per channel, from the block sums T_b (log2; R_b = T_0 + .. + T_(b-1), G_C = R_4), once a chunk:
  static constexpr uint32_t kER = kTotals + kBlocks * kD * 4;    // [4][128] e^R_b: Qt, Kt of block b
  static constexpr uint32_t kEKr = kER + kBlocks * kD * 4;       // [4][128] e^(G_C - R_(b+1)): Kr of block b
  // [3][128] e^(R_b - R_(j+1)) for (b, j) = (2, 0), (3, 1), (3, 0), over the first rows of the block
  // sums, which each channel's thread reads before it writes them.
  static constexpr uint32_t kEGap = kTotals;
  static constexpr uint32_t kDecay = kEKr + kBlocks * kD * 4;    // [128] e^G_C, read by the step
  static constexpr uint32_t kBarriers = kDecay + kD * 4;         // q/k/g full[2], v full[2]
  static constexpr uint32_t kItemSeq = kBarriers + 4 * 8;        // int64: the block's sequence (FusedParams::longest_first)
  static constexpr uint32_t kPeerIn = kItemSeq + 8;              // a pair's barrier: the other block's chunk handed over (PeerIn)
  // FusedParams::split_shared (OperandShare in fused_kernel.cu): kPeerIn's barrier counts the other
  // block's operands in; this one, the other block's steps on the operands this block sent; and
  // e^G_C of the chunk received (its operand stage and Kr^T take the second input stage's place).
  static constexpr uint32_t kPeerEmpty = kPeerIn + 8;
  static constexpr uint32_t kPeerDecay = (kPeerEmpty + 8 + 15) / 16 * 16;  // [128] fp32
  static constexpr uint32_t kBytes = kPeerDecay + kD * 4;
};

constexpr uint32_t kLBlocksBytes = lower_block(kBlocks, 0);  // L's lower blocks, fp32, beta folded; X_bb over L_bb
// Z = L_BA X_AA: the four blocks (2 + i / 2, i % 2) of the inverse's middle level (halves A, B of
// 32 tokens; fused_kernel.cu, invert_below_and_w), fp32 [16][kBlockStride] each.
constexpr uint32_t kZBlocksBytes = 4 * kBlockTileBytes;
static_assert(kBlocks == 4, "the inverse by halves of two blocks");

// Sequences the fused prefill takes longest first (FusedParams::longest_first): each block ranks
// them itself at its start (O(N) loads a thread), so only for a few.
constexpr int64_t kMaxLongestFirstSeqs = 64;

// The chunks a block runs, and the input stage each one's q, k, g and v land in. One block an item
// runs every chunk through two stages; a pair's block (below) every other chunk through one. A
// block's n-th chunk is its n-th fill of the stages: stage n % stages, phase (n / stages) % 2 (the
// stage ring's cursor, stage_ring.cuh, whose empty side this kernel does not use: the block-wide
// barriers of the chunk after release a stage).
struct Fill {
  int stage;
  uint32_t phase;
};
struct Schedule {
  int first;   // the block's first chunk: 0, or its rank in a pair
  int shift;   // log2 of the step between its chunks
  int stages;  // input stages: kInStages, or 1 in a pair
  __host__ __device__ constexpr int chunk(int n) const { return first + (n << shift); }
  __host__ __device__ constexpr int ahead(int c, int n) const { return c + (n << shift); }  // the block's chunk n after c
  __host__ __device__ constexpr Fill at(int c) const {
    const int n = (c - first) >> shift;
    return {n % stages, static_cast<uint32_t>(n / stages) & 1u};
  }
  // A pair: the parity of the hand-over before chunk c (the other block's chunk c - 1), the
  // block's k-th (block 0 gets none before chunk 0).
  __host__ __device__ constexpr uint32_t handover_parity(int c) const {
    return static_cast<uint32_t>(((c - first) >> shift) - (first == 0 ? 1 : 0)) & 1u;
  }
};
// Over an item of `chunks`: a pair's two blocks take every chunk once, alternately; each block's
// fills go round its stages with the phase flipping a lap; each block's hand-overs alternate
// parity from 0; the one-block schedule is 0, 1, 2, .. on two stages.
constexpr bool schedules_agree(int chunks) {
  for (int rank = 0; rank < 2; ++rank) {
    const Schedule s{rank, 1, 1};
    int n = 0;
    for (int c = s.chunk(0); c < chunks; c = s.ahead(c, 1), ++n) {
      if (c % 2 != rank || s.chunk(n) != c) return false;
      const Fill f = s.at(c);
      if (f.stage != 0 || f.phase != static_cast<uint32_t>(n % 2)) return false;
      if (c > 0 && s.handover_parity(c) != static_cast<uint32_t>((rank == 0 ? n - 1 : n) % 2)) return false;
    }
  }
  const Schedule one{0, 0, 2};
  for (int c = 0; c < chunks; ++c)
    if (one.at(c).stage != c % 2 || one.at(c).phase != static_cast<uint32_t>((c / 2) % 2) || one.ahead(c, 1) != c + 1) return false;
  return true;
}
static_assert(schedules_agree(9) && schedules_agree(10), "the chunk schedules");

// A pair (FusedParams::pair): two blocks of a cluster take one item, block r its chunks r, r + 2,
// .., each block's chunks one input stage at a time (the next one's q, k, g and v can be
// prefetched into the L2 a chunk ahead); the second stage's place takes what the other block
// hands over. Both blocks keep the whole state, and the owner of a chunk hands the other what its
// update needs: U^T (the fp16 A fragments its own update takes) with the rows' scales, and Kr^T
// and e^G_C; before its next chunk the other block applies that update to its own copy, the same
// operations on the same operands. 32 KB a chunk, Kr^T beside the step's first product and U^T
// right after U (S^T itself after each step, 64 KB, cost ~4.2K cycles of a ~7.3K step through
// distributed shared memory at 5a4ac03, and 9% more time at P4 and P10 at 0b9c88e). Its layout:
struct PeerIn {
  static constexpr uint32_t kU = 0;                                // U^T: a math thread's ua[4] as 4 uint4 at [k-step][thread]
  static constexpr uint32_t kE = kU + kMathThreads * 4 * 16;       // the rows' scales e_row: int2 at [thread]
  static constexpr uint32_t kKr = (kE + kMathThreads * 8 + 1023) / 1024 * 1024;  // Kr^T (the [128][64] tile image of kSmemKrT), after the scales on a 1024-byte boundary
  static constexpr uint32_t kDecay = kKr + kKrTBytes;               // e^G_C: [128] fp32
  static constexpr uint32_t kBytes = kDecay + kD * 4;
};

constexpr uint32_t kSmemIn = 0;
constexpr uint32_t kSmemOp = kSmemIn + kInStages * kInBytes;
constexpr uint32_t kSmemPeerIn = kSmemIn + kInBytes;  // a pair's: the second input stage's place
// What a pair's block receives fits the second input stage.
static_assert(kInStages == 2 && PeerIn::kBytes <= kInBytes, "a pair's hand-over fits");
constexpr uint32_t kSmemKrT = kSmemOp + OpStage::kBytes;
static_assert(OpStage::kM + tile_offset(kC, 0, kC) == OpStage::kBytes, "Kr^T's rows continue M's (kSmemKrT right after the stage)");
constexpr uint32_t kSmemL = kSmemKrT + kKrTBytes;
constexpr uint32_t kSmemZ = kSmemL + kLBlocksBytes;
constexpr uint32_t kSmemSmall = kSmemZ + kZBlocksBytes;
constexpr uint32_t kSmemBytes = kSmemSmall + Small::kBytes;
static_assert(kSmemSmall % 16 == 0, "16-byte stores into the small arrays");
// A shared split run receives the other block's operand stage and Kr^T, as they lie, into the second input stage's place.
static_assert(OpStage::kBytes + kKrTBytes == kInBytes, "an operand stage and Kr^T fill an input stage");
static_assert(kSmemBytes <= 227 * 1024, "fits one block a multiprocessor");

}  // namespace flashkda::gpu::fused
