// The fused chunk-64 prefill (layouts and roles: fused_config.h). One block a (sequence, head) of
// twelve warps. All of them prepare a chunk's operands in shared memory; then warpgroups 1 and 2
// (math) run the chunk's state step on wgmma, each owning 64 value rows of S^T in fp32 registers,
// while warpgroup 0 (prep) starts the next chunk. Nothing goes through device memory but the
// inputs, out and the states.
//
// The chunk form (docs/contract.md), with U's product order W (V - Kt S) so that prep forms no
// W Kt (its own phase: ~19% of a chunk at f6606a9; tools/numerics/chunk64_precision.py, f16-yform:
// the same error as the W V - (W Kt) S order):
//   U = W (V - Kt S),   O = Qt S + M U,   S' = Diag(exp(G_C)) S + Kr^T U
// and on the value rows v of S^T, with a power-of-two scale 2^e_v per row (S^ = S 2^-e_v, set
// each chunk so that max(|S_v|, |V_v|) 2^-e_v lies in [4, 8): fp16 operands never overflow):
//   Y^T = V^T - S^T Kt^T          m64n64, the accumulator set to V^T: 8 wgmma with A negated
//   P^T = S^T Qt^T                8 wgmma, beside Y's
//   U^T = Y^T W^T                 4 wgmma (Y^T rounded to fp16 as A: |Y^| <= 8 + 8 sqrt(128))
//   [P^T | S^T] += U^T [M^T | Kr]  4 wgmma m64n192k16 (S^T D first): O^T = P^T 2^e_v
//
// A chunk's prep, in phases between block-wide barriers (warp w: token block b = w % 4, channel
// part w / 4; lane (g, t) tokens g, g + 8 of the block at channels 8 kk + 2t, + 1: the fragment
// layout of the block's own products, so that the diagonal blocks of L and M come from registers):
//   0. (prep warpgroup, beside the previous chunk's step) beta, the norms of q and k;
//   1. the elementwise pass over the part's channel groups: the gate a and G - R_b by a scan across
//      the lanes of a quad column (R_b: G before the block), the fp16 products in place of the
//      inputs (q -> scale q^ e^(G - R_b), k -> k^ e^(G - R_b), g -> k^ e^(T_b - G); T_b the block's
//      sum), the block sums, and the part's share of L_bb, M_bb in tf32 (operands up to e^80);
//      part 0 runs it beside the step, parts 1 and 2 (the math warpgroups) after it;
//   2. the parts' diagonal products added (fixed order); a table of per-channel factors (e^R_b,
//      e^(G_C - R_(b+1)), e^(R_b - R_(j+1))) from the block sums;
//   3. the six off-diagonal blocks of L and M (fp16 mma, B side k^ e^(R_b - G_j) = the g products
//      times e^(R_b - R_(j+1))), a block and matrix a warp; X_bb = (I + L_bb)^-1 by right-looking
//      substitution (prep warpgroup) beside Kt (math warpgroups);
//   4. (prep warpgroup) the blocks below the diagonal by halves (X_BA = -X_BB L_BA X_AA, three
//      levels of tf32 mma) and W = X Diag(beta) in fp16; beside it Qt and Kr^T (math warpgroups).
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/fused_config.h"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/cluster.cuh"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/fast_math.cuh"
#include "gpu/ptx/mma.cuh"
#include "gpu/ptx/movmatrix.cuh"
#include "gpu/ptx/wgmma_f16.cuh"
#include "gpu/ptx/wgmma_f16_pair.cuh"

namespace flashkda::gpu {
namespace {

using namespace fused;

// Registers a thread of each role after the hand-over (setmaxnreg): the launch gives 168 to all
// 384 threads (65536 / 384, down to a multiple of 8); prep gives some back and the math
// warpgroups, which hold S^T (64) and three accumulators, take them. setmaxnreg moves registers
// within the block's own allocation, so the two must fit the launch's: an increase past what the
// others released waits forever.
constexpr int kLaunchRegs = 168, kPrepRegs = 88, kMathRegs = 208;
static_assert(kPrepThreads * kPrepRegs + kMathThreads * kMathRegs <= kThreads * kLaunchRegs, "the block's registers");
template <int N>
__device__ __forceinline__ void set_max_registers_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void set_max_registers_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Named barriers. kPhaseBarrier (all threads) separates the phases of a chunk's prep; the prep
// warpgroup arrives on kInputsBarrier once a chunk's beta and norms are in, and the math warpgroups
// wait there. kPrepBarrier: the prep warpgroup's own; kMathBarrier + wg: a math warpgroup's.
constexpr int kPhaseBarrier = 1, kInputsBarrier = 2, kPrepBarrier = 3, kMathBarrier = 4;
// The non-aligned forms: the roles reach kPhaseBarrier and kInputsBarrier from different code
// (prep_rest<true> and <false>), and __syncthreads, bar.sync and bar.arrive (barrier.*.aligned)
// require every thread to execute the same barrier instruction (synccheck reported the
// divergence). ptxas adds a converged fast path to each; measured ~1-2% on P1.
__device__ __forceinline__ void named_sync(int id, int threads) { asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int threads) { asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }

// FLASHKDA_FUSED_TIMING (cmake -DFLASHKDA_FUSED_TIMING=ON, a diagnostic build): the first thread
// of each warpgroup of block 0 stamps clock64() at the phase boundaries of chunk kTimedChunk, and
// a one-thread kernel launched after it prints the stamps: where a chunk's time goes, without a
// profiler. The printf lives in that kernel: a function call anywhere in the fused kernel made
// ptxas serialize every wgmma in it (C7510), so stamps printed from it timed a serialized step.
#ifdef FLASHKDA_FUSED_TIMING
constexpr int kTimedChunk = 20, kMarks = 15;
__device__ long long g_fused_marks[kThreads / 128][kMarks];  // [warpgroup][mark]
#define FUSED_MARK(c, i)                                                                          \
  do {                                                                                            \
    if (blockIdx.x == 0 && (c) == kTimedChunk && threadIdx.x % 128 == 0) g_fused_marks[threadIdx.x / 128][i] = clock64(); \
  } while (0)
// Per warp (lane 0 of each of the twelve), phase 4 in finer steps: 0 past the barrier that opens
// it; prep warps 1 .. 5: before and past each of the levels' two barriers, and the end; math
// warps 1: the operand tiles written, 2: step_operands done, 3: past the barrier that closes it.
constexpr int kWarpMarks = 6;
__device__ long long g_fused_warp_marks[kWarps][kWarpMarks];
#define FUSED_WARP_MARK(c, i)                                                                     \
  do {                                                                                            \
    if (blockIdx.x == 0 && (c) == kTimedChunk && threadIdx.x % 32 == 0) g_fused_warp_marks[threadIdx.x / 32][i] = clock64(); \
  } while (0)
#else
#define FUSED_MARK(c, i) \
  do {                   \
  } while (0)
#define FUSED_WARP_MARK(c, i) \
  do {                        \
  } while (0)
#endif

__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
// An fp16 pair times per-channel factors, the factors rounded to fp16 (one packed multiply where
// the fp32 product took two conversions, two multiplies and a pack; tools/numerics,
// f16-yform-tiles-f16: 1.96-1.97e-3 at worst against 1.93e-3 with fp32 factors). The pack of a
// factor pair is shared by the calls that pass it.
__device__ __forceinline__ uint32_t scaled_f16x2(uint32_t x, float2 f) { return ptx::mul_f16x2(x, ptx::pack_f16x2(f.x, f.y)); }
template <typename T>
__device__ __forceinline__ T& at(uint8_t* base, uint32_t offset) {
  return *reinterpret_cast<T*>(base + offset);
}

// A [64 tokens][128] tile of one head as two boxes (fused_config.h's swizzled_offset).
__device__ __forceinline__ void load_tile(uint8_t* dst, const CUtensorMap* map, int head, int row, uint64_t* bar) {
  ptx::tensor_copy_3d_g2s(dst, map, 0, head, row, bar);
  ptx::tensor_copy_3d_g2s(dst + kBoxBytes, map, 64, head, row, bar);
}

struct Item {
  int64_t bos, len;
  int head;
  int64_t seq;
  // The split forms: the split pass's run (StateSplit; kSplitShared: 2S for segment 0's spare A
  // run), its segment's tokens in [bos, bos + len).
  int run = 0;
  __device__ int chunks() const { return static_cast<int>((len + kC - 1) / kC); }
  __device__ int count(int c) const { return static_cast<int>(len - int64_t{kC} * c < kC ? len - int64_t{kC} * c : kC); }
  __device__ int row(int c) const { return static_cast<int>(bos + int64_t{kC} * c); }
};

// The shared-memory regions of one chunk's prep and step.
struct Regions {
  uint8_t* in;     // the chunk's input stage
  uint8_t* op;     // the operand stage
  uint8_t* krt;    // Kr^T; the parts' partial diagonal products before it
  uint8_t* lblk;   // L's blocks; X_bb over L_bb
  uint8_t* zblk;   // Z = L_BA X_AA
  uint8_t* small;
  __device__ const float* f(uint32_t offset) const { return reinterpret_cast<const float*>(small + offset); }
  __device__ float* fw(uint32_t offset) const { return reinterpret_cast<float*>(small + offset); }
  // X_bj: the diagonal ones over L's, the others in the k tile (free once phase 3 is done).
  __device__ float* x(int b, int j) const { return reinterpret_cast<float*>((b == j ? lblk : in + kInK) + lower_block(b, j)); }
  __device__ float* l(int b, int j) const { return reinterpret_cast<float*>(lblk + lower_block(b, j)); }
  __device__ float* z(int b, int j) const { return reinterpret_cast<float*>(zblk + ((b - 2) * 2 + j) * kBlockTileBytes); }
};

// The input barriers: q, k, g of stage s complete on qkg[s], v on v[s]; `order`: which chunk goes where.
struct InBarriers {
  uint64_t* qkg;
  uint64_t* v;
  Schedule order;
};

__device__ __forceinline__ void load_qkg(const FusedParams& p, const Item& it, int c, uint8_t* in_stages, const InBarriers& bars) {
  const Fill at = bars.order.at(c);
  uint8_t* in = in_stages + at.stage * kInBytes;
  ptx::mbarrier_arrive_expect_tx(&bars.qkg[at.stage], kInQkgBytes);
  load_tile(in + kInQ, &p.q_tiles, it.head, it.row(c), &bars.qkg[at.stage]);
  load_tile(in + kInK, &p.k_tiles, it.head, it.row(c), &bars.qkg[at.stage]);
  load_tile(in + kInG, &p.g_tiles, it.head, it.row(c), &bars.qkg[at.stage]);
}
__device__ __forceinline__ void load_v(const FusedParams& p, const Item& it, int c, uint8_t* in_stages, const InBarriers& bars) {
  const Fill at = bars.order.at(c);
  ptx::mbarrier_arrive_expect_tx(&bars.v[at.stage], kSwizzledTileBytes);
  load_tile(in_stages + at.stage * kInBytes + kInV, &p.v_tiles, it.head, it.row(c), &bars.v[at.stage]);
}
// Form::kSplitShared: chunk c's v box `wg` (the box math warpgroup wg reads) into the one stage, on
// barrier v[wg] (every chunk's v in turn, parity c % 2).
__device__ __forceinline__ void load_v_box(const FusedParams& p, const Item& it, int c, int wg, uint8_t* in_stages, const InBarriers& bars) {
  ptx::mbarrier_arrive_expect_tx(&bars.v[wg], kBoxBytes);
  ptx::tensor_copy_3d_g2s(in_stages + kInV + wg * kBoxBytes, &p.v_tiles, 64 * wg, it.head, it.row(c), &bars.v[wg]);
}
// A pair's block, one input stage: chunk c's q, k, g and v into the L2 a chunk before their
// stage is free, so that the copies into it wait for the L2, not device memory.
__device__ __forceinline__ void prefetch_inputs(const FusedParams& p, const Item& it, int c) {
  for (const CUtensorMap* map : {&p.q_tiles, &p.k_tiles, &p.g_tiles, &p.v_tiles}) {
    ptx::tensor_prefetch_3d_l2(map, 0, it.head, it.row(c));
    ptx::tensor_prefetch_3d_l2(map, 64, it.head, it.row(c));
  }
}

// ---------------------------------------------------------------------------------------------
// Prep (every warp)
// ---------------------------------------------------------------------------------------------

struct PrepWarp {
  int warp, lane, g, t;  // warp 0 .. 11 of the block
  __device__ int block() const { return warp % kBlocks; }
  __device__ int part() const { return warp / kBlocks; }
  __device__ int tok0() const { return kBlock * block() + g; }  // this lane's tokens: tok0, tok0 + 8
  static __device__ PrepWarp of_thread() {
    const int tid = static_cast<int>(threadIdx.x);
    return {tid / 32, tid % 32, (tid % 32) / 4, tid % 4};
  }
  // The same values, opaque to the compiler: formed at the top of each chunk, they keep ptxas from
  // hoisting the addresses derived from them out of the chunk loop (where they were spilled).
  __device__ PrepWarp laundered() const {
    PrepWarp L = *this;
    asm volatile("" : "+r"(L.warp), "+r"(L.lane), "+r"(L.g), "+r"(L.t));
    return L;
  }
};

// Phase 0's beta: the bf16 bits of token `tid` of chunk c (0 past the chunk's tokens), loaded a
// chunk ahead of their use so that the device-memory latency hides behind a chunk's prep. The
// bits stay raw until chunk_scalars: a conversion here would wait for the load at once.
// `head_beta`: the item's first token's beta (a sequence lies in one batch row of the view, so
// its tokens follow at p.beta.token elements each; no division a load).
__device__ __forceinline__ uint32_t beta_bits(const FusedParams& p, const Item& it, const uint16_t* head_beta, int c, int tid) {
  if (c >= it.chunks() || tid >= it.count(c)) return 0u;
  return head_beta[(int64_t{kC} * c + tid) * p.beta.token];
}

// A partial chunk's rows past its tokens (the next sequence's, or the copy engine's zero fill):
// q and k to 0, g to -inf (prep warpgroup, before phase 0). Then a padding token's norms are finite
// and every product of it is 0, and its gate is exactly 0 (sigmoid(-exp(A_log) (-inf + dt_bias)):
// ex2(+inf) = inf, rcp(inf) = 0), so the elementwise pass needs no test a token.
__device__ __forceinline__ void clear_padding_rows(const Regions& R, int count) {
  const uint32_t chunks = static_cast<uint32_t>(kC - count) * 16;  // 16-byte chunks: 8 a row of a box, two boxes
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u), neg_inf = make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
#pragma unroll 1
  for (uint32_t i = threadIdx.x; i < chunks; i += kPrepThreads) {
    const uint32_t row = static_cast<uint32_t>(count) + i / 16, box = (i / 8) % 2;
    const uint32_t off = box * kBoxBytes + row * 128 + (i % 8) * 16;  // all of the row's chunks, whatever the swizzle
    at<uint4>(R.in, kInQ + off) = zero, at<uint4>(R.in, kInK + off) = zero, at<uint4>(R.in, kInG + off) = neg_inf;
  }
  named_sync(kPrepBarrier, kPrepThreads);  // before phase 0 reads the rows
}

// Phase 0 (prep warpgroup): sigmoid(beta) of the chunk's tokens (`beta` from beta_bits, a chunk
// ahead) and scale / ||q||, 1 / ||k||. Thread (token tid / 2, box tid % 2) sums the squares of
// its token's 64 channels in that box from 16-byte loads on the FMA pipe, the boxes' sums joined
// by one shuffle: as bf16 mma the norms queued behind the step's wgmma on the tensor pipe (28% of
// this phase's stall samples were "math" at 78771e9, P1).
__device__ __forceinline__ void chunk_scalars(const FusedParams& p, const Item& it, int c, uint32_t beta, const PrepWarp& L, const Regions& R) {
  const int count = it.count(c);
  const uint32_t tid = 32 * L.warp + L.lane;
  const uint32_t tok = tid / 2, box = tid % 2;
  // The 16-byte chunks in the order (j ^ tok ^ 4 box) % 8: a quarter warp (tokens 4i .. 4i + 3,
  // both boxes) reads eight different bank groups each load.
  const uint32_t row = box * kBoxBytes + tok * 128;
  float sq[2][4] = {};  // [q, k][partial sums]
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t off = row + ((j ^ tok ^ (4 * box)) % 8) * 16;
    const uint4 q = at<uint4>(R.in, kInQ + off), k = at<uint4>(R.in, kInK + off);
    const uint32_t qw[4] = {q.x, q.y, q.z, q.w}, kw[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      sq[0][w] = fmaf(bf16_lo(qw[w]), bf16_lo(qw[w]), sq[0][w]), sq[0][w] = fmaf(bf16_hi(qw[w]), bf16_hi(qw[w]), sq[0][w]);
      sq[1][w] = fmaf(bf16_lo(kw[w]), bf16_lo(kw[w]), sq[1][w]), sq[1][w] = fmaf(bf16_hi(kw[w]), bf16_hi(kw[w]), sq[1][w]);
    }
  }
  float n[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    n[x] = (sq[x][0] + sq[x][1]) + (sq[x][2] + sq[x][3]);
    n[x] += __shfl_xor_sync(0xffffffffu, n[x], 1);
  }
  // Stored after the loads above: ptxas keeps loads behind an earlier store.
  if (tid < kC) R.fw(Small::kBeta)[tid] = tid < static_cast<uint32_t>(count) ? ptx::rcp_ftz(1.0f + ptx::exp2_ftz(-ptx::kLog2e * __uint_as_float(beta << 16))) : 0.f;
  // q^'s scale folded in; a padding token's rows are cleared (clear_padding_rows): finite norms
  if (box == 0) {
    R.fw(Small::kRq)[tok] = p.scale * rsqrtf(n[0] + 1e-6f);
    R.fw(Small::kRk)[tok] = rsqrtf(n[1] + 1e-6f);
  }
}

// C fragments of a 16 x 16 product: [n-tile][4] (rows g, g + 8; columns 8 n + 2t, + 1).
using Frag16 = float[2][4];

// Phase 1's shared-memory reads of one channel group: the lane's q, k, g pairs at its two tokens
// and the gate bias at its two channels. Read for two groups before either group's stores: the
// stores go over the same tiles, so ptxas kept each group's reads behind the previous group's
// stores and the groups' dependent chains (gate, scan, exponentials) ran one after the other.
struct GroupInputs {
  uint32_t q[2], k[2], g[2];  // [token half] bf16 pairs
  float2 bias;
  uint32_t o[2];  // byte offsets of the lane's pair in a tile, [token half]
};
// A lane's pair in a swizzled tile at channel group kk: its row's 16-byte chunk kk % 8 lies at
// (kk % 8) ^ (tok % 8), so the offset is a per-lane base XOR 16 (kk % 8), plus the box (kk / 8);
// token tok + 8 is 1024 bytes on (the general swizzled_offset took ~12 instructions a group).
struct GroupRows {
  uint32_t base;  // swizzled_offset(tok, 2t) with the chunk bits set to tok % 8
  __host__ __device__ constexpr GroupRows(uint32_t tok, uint32_t t) : base(tok * 128 + (tok % 8) * 16 + 4 * t) {}
  __host__ __device__ constexpr uint32_t at(uint32_t kk) const { return (base ^ ((kk % 8) * 16)) + (kk / 8) * kBoxBytes; }
};
constexpr bool group_rows_agree() {  // every lane's first token (16 b + g), both token halves, every t and group
  for (uint32_t b = 0; b < kBlocks; ++b)
    for (uint32_t g = 0; g < 8; ++g)
      for (uint32_t t = 0; t < 4; ++t)
        for (uint32_t kk = 0; kk < kChannelGroups; ++kk) {
          const uint32_t tok = kBlock * b + g, o = GroupRows(tok, t).at(kk);
          if (o != swizzled_offset(tok, 8 * kk + 2 * t) || o + 8 * 128 != swizzled_offset(tok + 8, 8 * kk + 2 * t)) return false;
        }
  return true;
}
static_assert(group_rows_agree(), "GroupRows agrees with swizzled_offset");
__device__ __forceinline__ GroupInputs group_inputs(const PrepWarp& L, const Regions& R, const GroupRows& rows, int kk) {
  GroupInputs x;
  const int c = 8 * kk + 2 * L.t;
  x.o[0] = rows.at(static_cast<uint32_t>(kk)), x.o[1] = x.o[0] + 8 * 128;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    x.q[h] = at<uint32_t>(R.in, kInQ + x.o[h]), x.k[h] = at<uint32_t>(R.in, kInK + x.o[h]), x.g[h] = at<uint32_t>(R.in, kInG + x.o[h]);
  }
  x.bias = *reinterpret_cast<const float2*>(R.f(Small::kDtBias) + c);
  return x;
}

// Phase 1 on one channel group kk from its inputs: the gate and its scan, the block sums, the fp16
// products over the inputs, the part's share of the diagonal products (Ld, Md).
struct GroupScalars {  // per lane, constant over a chunk's groups (padding tokens: clear_padding_rows)
  float rq0, rq1, rk0, rk1;       // scale / ||q||, 1 / ||k|| of the two tokens
  float neg_expA_log2e, lb_log2e;
};
__device__ __forceinline__ void elementwise_group(const PrepWarp& L, const Regions& R, const GroupScalars& z, int kk, const GroupInputs& x,
                                                  Frag16& Ld, Frag16& Md) {
  const int b = L.block(), lane = L.lane, t = L.t;
  const int c = 8 * kk + 2 * t;
  // a log2(e): lower_bound sigmoid(exp(A_log) (v + dt_bias)), `bias` the table's -exp(A_log) log2(e) dt_bias
  auto gate = [&](float v, float bias) {
    return z.lb_log2e * ptx::rcp_ftz(1.0f + ptx::exp2_ftz(fmaf(z.neg_expA_log2e, v, bias)));
  };
  // [token half][channel]: inclusive scan over the 8 lanes g of a quad column, then half 1 adds half 0's sum.
  float G[2][2] = {{gate(bf16_lo(x.g[0]), x.bias.x), gate(bf16_hi(x.g[0]), x.bias.y)},
                   {gate(bf16_lo(x.g[1]), x.bias.x), gate(bf16_hi(x.g[1]), x.bias.y)}};
#pragma unroll
  for (int d = 4; d < 32; d <<= 1)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        const float y = __shfl_up_sync(0xffffffffu, G[h][ch], d);
        if (lane >= d) G[h][ch] += y;
      }
  float tot[2];  // the block's sum of a (log2) at the two channels
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    G[1][ch] += __shfl_sync(0xffffffffu, G[0][ch], 28 + t);
    tot[ch] = __shfl_sync(0xffffffffu, G[1][ch], 28 + t);
  }
  if (L.g == 0) *reinterpret_cast<float2*>(R.fw(Small::kTotals) + b * kD + c) = make_float2(tot[0], tot[1]);
  const float e_tot[2] = {ptx::exp2_ftz(tot[0]), ptx::exp2_ftz(tot[1])};
  // [half][channel] k^, scale q^ (zero for padding tokens: their rows are cleared)
  const float kh[2][2] = {{bf16_lo(x.k[0]) * z.rk0, bf16_hi(x.k[0]) * z.rk0}, {bf16_lo(x.k[1]) * z.rk1, bf16_hi(x.k[1]) * z.rk1}};
  const float qh[2][2] = {{bf16_lo(x.q[0]) * z.rq0, bf16_hi(x.q[0]) * z.rq0}, {bf16_lo(x.q[1]) * z.rq1, bf16_hi(x.q[1]) * z.rq1}};
  // e^(T_b - G) = e^T_b e^-G: the block's sum and G are at most 16 * 5 / ln 2 in size, so both
  // factors and the product stay normal in fp32.
  float ka[2][2], qa[2][2], kb[2][2], kr[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      const float e = ptx::exp2_ftz(G[h][ch]), e_inv = ptx::exp2_ftz(-G[h][ch]);
      ka[h][ch] = kh[h][ch] * e, qa[h][ch] = qh[h][ch] * e, kb[h][ch] = kh[h][ch] * e_inv;
      kr[h][ch] = kb[h][ch] * e_tot[ch];
    }
  // tf32 m16n8k8 with k-slot t = channel c, t + 4 = c + 1 (mma.cuh): A rows = tokens g, g + 8.
  // The operands go in as fp32 bit patterns: the tensor core truncates them to tf32.
  const uint32_t a_k[4] = {__float_as_uint(ka[0][0]), __float_as_uint(ka[1][0]), __float_as_uint(ka[0][1]), __float_as_uint(ka[1][1])};
  const uint32_t a_q[4] = {__float_as_uint(qa[0][0]), __float_as_uint(qa[1][0]), __float_as_uint(qa[0][1]), __float_as_uint(qa[1][1])};
#pragma unroll
  for (int n = 0; n < 2; ++n) {  // B column g of n-tile n: token g + 8 n
    ptx::mma_tf32_1688(Ld[n], a_k, kb[n][0], kb[n][1]);
    ptx::mma_tf32_1688(Md[n], a_q, kb[n][0], kb[n][1]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    at<uint32_t>(R.in, kInK + x.o[h]) = ptx::pack_f16x2(ka[h][0], ka[h][1]);
    at<uint32_t>(R.in, kInQ + x.o[h]) = ptx::pack_f16x2(qa[h][0], qa[h][1]);
    at<uint32_t>(R.in, kInG + x.o[h]) = ptx::pack_f16x2(kr[h][0], kr[h][1]);
  }
}

// Phase 1: the elementwise pass of block L.block() over channel groups [kk0, kk1), two groups a
// trip (their reads first); Ld, Md take the part's share of the diagonal products L_bb, M_bb (fp32
// C fragments; n-tile = token half).
__device__ __forceinline__ void elementwise_pass(const FusedParams& p, const PrepWarp& L, const Regions& R, float neg_expA_log2e,
                                                 int kk0, int kk1, Frag16& Ld, Frag16& Md) {
  const int i0 = L.tok0(), i1 = i0 + 8;  // chunk rows of this lane's tokens
  const GroupScalars z{R.f(Small::kRq)[i0], R.f(Small::kRq)[i1], R.f(Small::kRk)[i0], R.f(Small::kRk)[i1],
                       neg_expA_log2e, ptx::kLog2e * p.lower_bound};
  const GroupRows rows(static_cast<uint32_t>(i0), static_cast<uint32_t>(L.t));
  int kk = kk0;
#pragma unroll 1
  for (; kk + 1 < kk1; kk += 2) {
    const GroupInputs x0 = group_inputs(L, R, rows, kk), x1 = group_inputs(L, R, rows, kk + 1);
    elementwise_group(L, R, z, kk, x0, Ld, Md);
    elementwise_group(L, R, z, kk + 1, x1, Ld, Md);
  }
  if (kk < kk1) elementwise_group(L, R, z, kk, group_inputs(L, R, rows, kk), Ld, Md);
}

// The partial products of parts 1 and 2 (fused_config.h, kPartialBytes).
__device__ __forceinline__ float4* partial_slot(const Regions& R, int part, int block, int which, int lane) {
  return reinterpret_cast<float4*>(R.krt) + ((((part - 1) * kBlocks + block) * 4 + which) * 32 + lane);
}

// A 16 x 16 block of C fragments as fp32 [16][kBlockStride] (L's and X's blocks), entries at or above the
// diagonal dropped where strictly_lower.
__device__ __forceinline__ void put_block(float* dst, const PrepWarp& L, const Frag16& c, bool strictly_lower, float sign) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = L.g + 8 * h, col = 8 * n + 2 * L.t + e;
        const bool keep = !strictly_lower || col < r;
        dst[r * kBlockStride + col] = keep ? sign * c[n][2 * h + e] : 0.f;
      }
}
// Block (ib, jb) of M in fp16 into the operand stage, entries above the diagonal dropped where diag.
__device__ __forceinline__ void put_m(uint8_t* op, const PrepWarp& L, const Frag16& c, int ib, int jb, bool diag) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = L.g + 8 * h, col = 8 * n + 2 * L.t;
      const float x0 = (!diag || col <= r) ? c[n][2 * h] : 0.f, x1 = (!diag || col + 1 <= r) ? c[n][2 * h + 1] : 0.f;
      at<uint32_t>(op, OpStage::kM + tile_offset(kBlock * ib + r, kBlock * jb + col, kC)) = ptx::pack_f16x2(x0, x1);
    }
}

// Phase 2 (prep warpgroup, warp b): L_bb (beta_i folded) and M_bb from the three parts' products.
__device__ __forceinline__ void put_diagonal(const PrepWarp& L, const Regions& R, Frag16& Ld, Frag16& Md) {
  const int b = L.block();
#pragma unroll
  for (int part = 1; part < kParts; ++part)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float4 l = *partial_slot(R, part, b, n, L.lane), m = *partial_slot(R, part, b, 2 + n, L.lane);
      Ld[n][0] += l.x, Ld[n][1] += l.y, Ld[n][2] += l.z, Ld[n][3] += l.w;
      Md[n][0] += m.x, Md[n][1] += m.y, Md[n][2] += m.z, Md[n][3] += m.w;
    }
  const float* beta = R.f(Small::kBeta);
  const float bi[2] = {beta[L.tok0()], beta[L.tok0() + 8]};
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) Ld[n][e] *= bi[e >> 1];
  put_block(R.x(b, b), L, Ld, true, 1.f);  // X_bb's place is L_bb's
  put_m(R.op, L, Md, b, b, true);
}

// Phase 2 (a math warpgroup, thread = channel): the per-channel factors from the block sums.
__device__ __forceinline__ void factor_table(const Regions& R, int c) {
  const float* totals = R.f(Small::kTotals);
  float T[kBlocks], S[kBlocks + 1] = {0.f};
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) T[b] = totals[b * kD + c], S[b + 1] = S[b] + T[b];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    R.fw(Small::kER)[b * kD + c] = ptx::exp2_ftz(S[b]);
    R.fw(Small::kEKr)[b * kD + c] = ptx::exp2_ftz(S[kBlocks] - S[b + 1]);
  }
  float* gap = R.fw(Small::kEGap);  // over the sums' first rows, read above by this thread only
  gap[0 * kD + c] = ptx::exp2_ftz(S[2] - S[1]);
  gap[1 * kD + c] = ptx::exp2_ftz(S[3] - S[2]);
  gap[2 * kD + c] = ptx::exp2_ftz(S[3] - S[1]);
  R.fw(Small::kDecay)[c] = ptx::exp2_ftz(S[kBlocks]);
}

// A lane's ldmatrix rows in a swizzled [64][64] box (swizzled_offset): row `tok`, 16-byte chunk
// 2u + h of the box at (2u + h) ^ (tok % 8) for the box's k-tiles u = 0 .. 3. h and tok are the
// lane's, u a compile-time index, so the chunk's byte offset is the lane's base XOR 32 u: one
// instruction an address (the general swizzled_offset cost ~15 a k-tile in the loops below).
struct BoxRows {
  uint32_t base;  // byte offset of k-tile 0's chunk in the box pair, box included
  __host__ __device__ constexpr BoxRows(uint32_t tok, uint32_t h, int box)
      : base(static_cast<uint32_t>(box) * (kC * 128) + tok * 128 + ((h ^ tok) & 1u) * 16 + (tok & 6u) * 16) {}
  __host__ __device__ constexpr uint32_t at(int u) const { return base ^ (32u * static_cast<uint32_t>(u)); }
};
static_assert(BoxRows(13, 1, 1).at(3) == swizzled_offset(13, 64 + 16 * 3 + 8) && BoxRows(6, 0, 0).at(2) == swizzled_offset(6, 32) &&
                  BoxRows(63, 1, 1).at(0) == swizzled_offset(63, 64 + 8) && BoxRows(2, 1, 0).at(1) == swizzled_offset(2, 24),
              "BoxRows agrees with swizzled_offset");

// Kt (kKt; phase 3, from the k products) or Qt and Kr^T (phase 4, from the q and g products, while
// the k tile holds X) of token block b over the 64 channels of box `box`, a 16-channel slab (k-tile
// u) at a time: ldmatrix from the swizzled tile, the per-channel factors, stmatrix into the wgmma
// tile (Kr^T transposed). Matrix m of a slab: tokens 16 b + 8 (m & 1) + i, channels 8 (m >> 1) + ..
template <bool kKt>
__device__ __forceinline__ void operand_tiles(const PrepWarp& L, const Regions& R, int b, int box) {
  const int m = L.lane / 8, i = L.lane % 8;
  const uint32_t tok = kBlock * b + 8 * (m & 1) + i;  // the row this lane addresses
  const BoxRows src(tok, static_cast<uint32_t>(m >> 1), box);
  const int kt0 = 4 * box;  // the box's first k-tile of 16 channels
  const float* eR = R.f(Small::kER) + b * kD + 16 * kt0 + 2 * L.t;
  const float* eKr = R.f(Small::kEKr) + b * kD + 16 * kt0 + 2 * L.t;
  // Destinations at k-tile kt0: tile_offset(tok, 16 kt + 8 (m >> 1), kD) and, transposed,
  // tile_offset(16 kt + 8 (m >> 1) + i, 16 b + 8 (m & 1), kC); each k-tile adds 256 and 2048 bytes.
  const uint32_t dst = tile_offset(tok, 16 * kt0 + 8 * (m >> 1), kD);
  const uint32_t dst_t = tile_offset(16 * kt0 + 8 * (m >> 1) + i, kBlock * b + 8 * (m & 1), kC);
  static_assert(tile_offset(8, 16, kD) - tile_offset(8, 0, kD) == 256 && tile_offset(16 + 3, 8, kC) - tile_offset(3, 8, kC) == 2048,
                "a k-tile's step in the wgmma tiles");
  // Every read first, then the products and the stores: the stores go to other tiles, but ptxas
  // kept each k-tile's reads behind the previous k-tile's stores (one dependent chain of ldmatrix,
  // HMUL2 and stmatrix a k-tile).
  auto factors = [](float2 (&e)[2], const float* f) {  // at channels 8 hh + 2t, + 1 of the slab
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) e[hh] = *reinterpret_cast<const float2*>(f + 8 * hh);
  };
  auto scale = [](uint32_t (&r)[4], const float2 (&e)[2]) {  // r[m] *= e[m >> 1]
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int h = 0; h < 2; ++h) r[2 * hh + h] = scaled_f16x2(r[2 * hh + h], e[hh]);
  };
  uint32_t r[4][4];
  float2 e[4][2];
  const uint32_t first = kKt ? kInK : kInQ;
#pragma unroll
  for (int u = 0; u < 4; ++u) ptx::ldmatrix_x4(ptx::smem_addr(R.in + first + src.at(u)), r[u]), factors(e[u], eR + 16 * u);
  if constexpr (!kKt) {
    uint32_t rg[4][4];
    float2 eg[4][2];
#pragma unroll
    for (int u = 0; u < 4; ++u) ptx::ldmatrix_x4(ptx::smem_addr(R.in + kInG + src.at(u)), rg[u]), factors(eg[u], eKr + 16 * u);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      scale(rg[u], eg[u]);
      // Transposed: column i of matrix m (channel 16 kt + 8 (m >> 1) + i) as 8 tokens from 16 b + 8 (m & 1).
      ptx::stmatrix_x4_trans(ptx::smem_addr(R.krt + dst_t + 2048 * u), rg[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    scale(r[u], e[u]);
    ptx::stmatrix_x4(ptx::smem_addr(R.op + (kKt ? OpStage::kKt : OpStage::kQt) + dst + 256 * u), r[u]);
  }
}

// Phase 3: one off-diagonal block, L_bj (warps 0 .. 5) or M_bj (6 .. 11), j < b: fp16 m16n8k16,
// A = block b's k or q products, B = block j's g products times e^(R_b - R_(j+1)) per channel,
// both by ldmatrix from the swizzled tiles (rows = tokens: a token-major slab is the A fragment and,
// with the n-tiles as matrix pairs, the B fragment).
__device__ __forceinline__ void off_diagonal_block(const PrepWarp& L, const Regions& R) {
  constexpr int kPairs = 6;
  static_assert(2 * kPairs == kWarps, "a block of L or M a warp");
  const int pair = L.warp % kPairs;
  const bool is_m = L.warp >= kPairs;
  // (b, j) = (1, 0), (2, 1), (3, 2), (2, 0), (3, 1), (3, 0) by arithmetic: a table indexed at run
  // time would live in local memory.
  const int b = pair < 3 ? pair + 1 : pair < 5 ? pair - 1 : 3;
  const int j = pair < 3 ? pair : pair == 4 ? 1 : 0;
  const float* gap = b - j == 1 ? nullptr : R.f(Small::kEGap) + (b == 2 ? 0 : j == 1 ? 1 : 2) * kD;  // e^(R_b - R_(j+1))
  const uint32_t a_tile = is_m ? kInQ : kInK;
  // ldmatrix rows, lane 8 m + i: A matrix m = (tokens 16 b + 8 (m & 1) + i, channels 8 (m >> 1) of
  // the k-tile): a[0..3]; B matrix m = (tokens 16 j + 8 (m >> 1) + i, channels 8 (m & 1)): n-tile
  // m >> 1, k half m & 1.
  const int m = L.lane / 8, i = L.lane % 8;
  const uint32_t a_row = kBlock * b + 8 * (m & 1) + i, b_row = kBlock * j + 8 * (m >> 1) + i;
  Frag16 acc = {};
#pragma unroll 1
  for (int box = 0; box < 2; ++box) {
    const BoxRows a_src(a_row, static_cast<uint32_t>(m >> 1), box), b_src(b_row, static_cast<uint32_t>(m & 1), box);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int kt = 4 * box + u;
      uint32_t a[4], bq[4];
      ptx::ldmatrix_x4(ptx::smem_addr(R.in + a_tile + a_src.at(u)), a);
      ptx::ldmatrix_x4(ptx::smem_addr(R.in + kInG + b_src.at(u)), bq);
      if (gap) {  // adjacent blocks: e^0
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float2 d = *reinterpret_cast<const float2*>(gap + 16 * kt + 8 * hh + 2 * L.t);
#pragma unroll
          for (int n = 0; n < 2; ++n) bq[2 * n + hh] = scaled_f16x2(bq[2 * n + hh], d);
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) ptx::mma_f16_16816(acc[n], a, bq[2 * n], bq[2 * n + 1]);
    }
  }
  const int r0 = kBlock * b + L.g, r1 = r0 + 8;
  if (is_m) {
    put_m(R.op, L, acc, b, j, false);
  } else {
    const float* beta = R.f(Small::kBeta);
    const float bb[2] = {beta[r0], beta[r1]};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] *= bb[e >> 1];
    put_block(R.l(b, j), L, acc, false, 1.f);
  }
}

// Phase 3 (prep warpgroup, warp b): X_bb = (I + L_bb)^-1 over L_bb, lane j < 16 computing column j
// in fp32. Right-looking: once x_m is known it leaves every later row at once, so the dependent
// chain is 16 FMAs long (a left-looking dot product per row made it 120).
__device__ __forceinline__ void invert_diagonal(const PrepWarp& L, const Regions& R) {
  float* blk = R.x(L.warp, L.warp);
  float x[kBlock];
  const int j = L.lane & 15;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) x[i] = i == j ? 1.f : 0.f;
#pragma unroll
  for (int m = 0; m < kBlock; ++m)
#pragma unroll
    for (int i = m + 1; i < kBlock; ++i) x[i] = fmaf(-blk[i * kBlockStride + m], x[m], x[i]);
  __syncwarp();  // every lane's reads of L_bb before X_bb goes over it
  if (L.lane < 16) {
#pragma unroll
    for (int i = 0; i < kBlock; ++i) blk[i * kBlockStride + j] = x[i];
  }
}

// Phase 4 (prep warpgroup): the blocks of X below the diagonal, by halves A (blocks 0, 1) and B
// (2, 3): X_BA = -X_BB L_BA X_AA. Three dependent levels of at most two tf32 products a warp
// (block levels took three of up to four, the last warp doing nine products in a row):
//   1. X_10 = -X_11 L_10 X_00 (warp 1), X_32 = -X_33 L_32 X_22 (warp 3); warps 0 and 2 write W's
//      diagonal blocks meanwhile;
//   2. Z = L_BA X_AA, warp w block (2 + w / 2, w % 2): Z_b0 = L_b0 X_00 + L_b1 X_10, Z_b1 = L_b1 X_11;
//   3. X_bj = -(X_b2 Z_2j + [b = 3] X_33 Z_3j), same blocks.
// Each warp writes W = X Diag(beta) (fp16) for the blocks it computed, from registers; W's blocks
// above the diagonal are zero from the start.
__device__ __forceinline__ void invert_below_and_w(const PrepWarp& L, const Regions& R, [[maybe_unused]] int c) {
  const int w = L.warp, g = L.g, t = L.t;
  const float* beta = R.f(Small::kBeta);
  auto a_frag = [&](const float* blk, int kt, uint32_t (&a)[4]) {  // rows g, g + 8; k-slots t, t + 4 of k-tile kt
    a[0] = __float_as_uint(blk[g * kBlockStride + 8 * kt + t]), a[1] = __float_as_uint(blk[(g + 8) * kBlockStride + 8 * kt + t]);
    a[2] = __float_as_uint(blk[g * kBlockStride + 8 * kt + t + 4]), a[3] = __float_as_uint(blk[(g + 8) * kBlockStride + 8 * kt + t + 4]);
  };
  using AFrags = uint32_t[2][4];  // a 16 x 16 A operand: [k-tile][4]
  auto a_frags = [&](const float* A, AFrags& a) {
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) a_frag(A, kt, a[kt]);
  };
  auto product_a = [&](const AFrags& a, const float* B, Frag16& c) {  // c += A B, 16 x 16 x 16 in tf32
#pragma unroll
    for (int kt = 0; kt < 2; ++kt)
#pragma unroll
      for (int n = 0; n < 2; ++n)
        ptx::mma_tf32_1688(c[n], a[kt], B[(8 * kt + t) * kBlockStride + 8 * n + g], B[(8 * kt + t + 4) * kBlockStride + 8 * n + g]);
  };
  // Every shared-memory read a warp can make before its first store is made first: ptxas kept
  // reads behind earlier stores (the beta pairs of W's columns, the second diagonal block), one
  // dependent load, multiply and store at a time.
  using BetaPairs = float2[2];  // beta at columns 8 n + 2t, + 1 of a block, [n]
  auto beta_pairs = [&](int j, BetaPairs& bp) {
#pragma unroll
    for (int n = 0; n < 2; ++n) bp[n] = *reinterpret_cast<const float2*>(beta + kBlock * j + 8 * n + 2 * t);
  };
  auto put_w = [&](const Frag16& x, int b, int j, const BetaPairs& bp, float sign) {  // W_bj = sign X_bj Diag(beta_j)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h, col = 8 * n + 2 * t;
        at<uint32_t>(R.op, OpStage::kW + tile_offset(kBlock * b + row, kBlock * j + col, kC)) =
            ptx::pack_f16x2(x[n][2 * h] * (sign * bp[n].x), x[n][2 * h + 1] * (sign * bp[n].y));
      }
  };
  const int b3 = 2 + w / 2, j3 = w % 2;  // the block of levels 2 and 3
  BetaPairs beta3;
  beta_pairs(j3, beta3);
  if (w & 1) {  // level 1
    const int b = w, j = w - 1;
    BetaPairs bp;
    beta_pairs(j, bp);
    AFrags xbb;
    a_frags(R.x(b, b), xbb);
    // -X_bj = (X_bb L_bj) X_jj, the first product's C fragments as the second's A operand in
    // registers: k-slot t of k-tile kt is column 8 kt + 2t, slot t + 4 column 8 kt + 2t + 1, so
    // X_jj gives its rows in that order (no round trip through shared memory).
    Frag16 y = {};
    product_a(xbb, R.l(b, j), y);
    AFrags ya;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt)
      ya[kt][0] = __float_as_uint(y[kt][0]), ya[kt][1] = __float_as_uint(y[kt][2]), ya[kt][2] = __float_as_uint(y[kt][1]),
      ya[kt][3] = __float_as_uint(y[kt][3]);
    const float* xjj = R.x(j, j);
    Frag16 x = {};
#pragma unroll
    for (int kt = 0; kt < 2; ++kt)
#pragma unroll
      for (int n = 0; n < 2; ++n)
        ptx::mma_tf32_1688(x[n], ya[kt], xjj[(8 * kt + 2 * t) * kBlockStride + 8 * n + g], xjj[(8 * kt + 2 * t + 1) * kBlockStride + 8 * n + g]);
    put_block(R.x(b, j), L, x, false, -1.f);
    put_w(x, b, j, bp, -1.f);
  } else {
    Frag16 x[2];
    BetaPairs bp[2];
#pragma unroll
    for (int d = 0; d < 2; ++d) {  // W_bb for b = w, w + 1
      const float* X = R.x(w + d, w + d);
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[d][n][e] = X[(g + 8 * (e >> 1)) * kBlockStride + 8 * n + 2 * t + (e & 1)];
      beta_pairs(w + d, bp[d]);
    }
#pragma unroll
    for (int d = 0; d < 2; ++d) put_w(x[d], w + d, w + d, bp[d], 1.f);
  }
  // Levels 2 and 3 as two independent products a warp, added at the end (two mma chains of two
  // k-tiles instead of one of four, their reads all first); a warp with one term computes a second
  // from valid blocks and drops it.
  auto two_products = [&](const float* A0, const float* B0, const float* A1, const float* B1, bool both, Frag16& c) {
    AFrags a0, a1;
    a_frags(A0, a0), a_frags(A1, a1);
    Frag16 c1 = {};
    product_a(a0, B0, c), product_a(a1, B1, c1);
    if (both)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] += c1[n][e];
  };
  FUSED_WARP_MARK(c, 1);
  named_sync(kPrepBarrier, kPrepThreads);  // X_10, X_32
  FUSED_WARP_MARK(c, 2);
  Frag16 z = {};  // Z_bj = L_b1 X_1j + [j = 0] L_b0 X_00
  two_products(R.l(b3, 1), R.x(1, j3), R.l(b3, 0), R.x(0, 0), j3 == 0, z);
  put_block(R.z(b3, j3), L, z, false, 1.f);
  FUSED_WARP_MARK(c, 3);
  named_sync(kPrepBarrier, kPrepThreads);  // Z
  FUSED_WARP_MARK(c, 4);
  Frag16 x = {};  // -X_bj = X_b2 Z_2j + [b = 3] X_33 Z_3j
  two_products(R.x(b3, 2), R.z(2, j3), R.x(3, 3), R.z(3, j3), b3 == 3, x);
  put_w(x, b3, j3, beta3, -1.f);
  FUSED_WARP_MARK(c, 5);
}

// The thread of a math warpgroup that stored its box of the previous chunk's out rows (step)
// waits until the copy engine has read it: before the phase barrier after which the box's stage
// is refilled, and before the block exits.
__device__ __forceinline__ void out_box_read() {
  if (threadIdx.x % 128 == 0) ptx::bulk_wait_group_read<0>();
}

// Phases 2 to 4 of chunk c, by every thread of the block after its part of the elementwise pass
// (kPrep: the prep warpgroup's instance). Returns with this thread's part of the operand stage and
// Kr^T written and fenced for wgmma; operands_ready() waits for the others'.
template <bool kPrep, bool kLoadsV = true>
__device__ __forceinline__ void prep_rest(const FusedParams& p, const Item& it, int c, const PrepWarp& L, const Regions& R, uint8_t* in_stages,
                                          const InBarriers& bars, Frag16& Ld, Frag16& Md) {
  if constexpr (!kPrep) {  // parts 1 and 2 hand their diagonal products over
    out_box_read();  // chunk c - 1's box: its stage takes chunk c + 1's v after the barrier below
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      *partial_slot(R, L.part(), L.block(), n, L.lane) = make_float4(Ld[n][0], Ld[n][1], Ld[n][2], Ld[n][3]);
      *partial_slot(R, L.part(), L.block(), 2 + n, L.lane) = make_float4(Md[n][0], Md[n][1], Md[n][2], Md[n][3]);
    }
  }
  FUSED_MARK(c, 3);
  named_sync(kPhaseBarrier, kThreads);  // the elementwise pass; the math warpgroups past chunk c - 1's step
  FUSED_MARK(c, 4);
  if constexpr (kPrep) {
    // The next chunk's v into the stage the previous chunk's step has left (one input stage: this
    // chunk's own v).
    const int cv = bars.order.ahead(c, bars.order.stages - 1);
    if (kLoadsV && threadIdx.x == 0 && cv < it.chunks()) load_v(p, it, cv, in_stages, bars);
    put_diagonal(L, R, Ld, Md);
  } else {
    if (L.part() == 1) factor_table(R, static_cast<int>(threadIdx.x) - kPrepThreads);
  }
  FUSED_MARK(c, 5);
  named_sync(kPhaseBarrier, kThreads);  // the factors, the diagonal blocks; the partials read (Kr^T's place free)
  FUSED_MARK(c, 6);
  // Phases 3 and 4: the prep warpgroup inverts (X_bb, then the levels) while the math warpgroups
  // write the operand tiles, a token block and half of the channel groups a warp.
  const int tile_block = (L.warp - kPrepThreads / 32) % kBlocks, tile_box = (L.warp - kPrepThreads / 32) / kBlocks;
  static_assert(kMathThreads / 32 == 2 * kBlocks && kD == 2 * 64, "two math warps a token block, a box of 64 channels each");
  if constexpr (kPrep) invert_diagonal(L, R);
  else operand_tiles<true>(L, R, tile_block, tile_box);
  off_diagonal_block(L, R);
  FUSED_MARK(c, 7);
  named_sync(kPhaseBarrier, kThreads);  // L's blocks, X_bb; the k products read (the k tile free for X)
  FUSED_WARP_MARK(c, 0);
  if constexpr (kPrep) {
    invert_below_and_w(L, R, c);
  } else {
    operand_tiles<false>(L, R, tile_block, tile_box);
    FUSED_WARP_MARK(c, 1);
  }
  FUSED_MARK(c, 8);
  ptx::fence_proxy_async_shared();  // the tiles, written by ordinary stores, read by wgmma; the
                                    // input stage's q, k, g refilled by the copy engine next
}
// The barrier after phase 4: the operand stage and Kr^T complete and visible to wgmma.
__device__ __forceinline__ void operands_ready(int c) {
  named_sync(kPhaseBarrier, kThreads);
  FUSED_MARK(c, 9);
}

// ---------------------------------------------------------------------------------------------
// Math (warpgroups 1, 2)
// ---------------------------------------------------------------------------------------------

// 2^e for the exponent of x (x > 0 finite), as a float: floor(log2 x).
__device__ __forceinline__ int exponent_of(float x) { return static_cast<int>((__float_as_uint(x) >> 23) & 0xffu) - 127; }
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

struct MathLane {
  int wg, warp, lane, g, t;  // wg: 0 or 1 (value rows 64 wg ..)
  __device__ int row(int h) const { return kMathRows * wg + 16 * warp + g + 8 * h; }
  __device__ int thread() const { return 128 * wg + 32 * warp + lane; }
  __device__ MathLane laundered() const {  // as PrepWarp::laundered
    MathLane L = *this;
    asm volatile("" : "+r"(L.wg), "+r"(L.warp), "+r"(L.lane), "+r"(L.g), "+r"(L.t));
    return L;
  }
};

// The kernel's three forms: one block an item; a pair's block (FusedParams::pair), which hands the
// other block the update of its chunk for that block's own copy of the state (PeerLink); and one
// block a (run, head) of the split pass (kSplitRun, FusedParams::split_runs, StateSplit's runs):
// run 0 takes segment 0 from the initial state as kOne does, run 2s - 1 segment s from zero (B_s),
// run 2s from the identity with v = 0 (A_s), both writing fp32 out rows and an fp32 final state
// into the split's buffers for the stitch kernels. kSplitShared (FusedParams::split_shared): the
// same runs, a segment's two as the two blocks of a cluster that each prepare every other chunk and
// hand the other its operands (OperandShare); segment 0's second block runs a spare A run whose
// rows go to out_a's unused rows of segment 0 and whose state is not stored (run 2S).
enum class Form { kOne, kPair, kSplitRun, kSplitShared };
constexpr bool is_split(Form f) { return f == Form::kSplitRun || f == Form::kSplitShared; }

// S^T rows row(0), row(1) of one math thread; columns 8 j + 2t, + 1 (j < 16): an m64n128 D
// accumulator, with the rows' power-of-two scales (S^ = S 2^-e_row).
struct StateRows {
  float s[64];
  int e_row[2] = {0, 0};
  // Row h (of the two) to the scale 2^-e: exact, a power of two.
  __device__ __forceinline__ void set_scale(int h, int e) {
    const float f = pow2(e_row[h] - e);
#pragma unroll
    for (int j = 0; j < 16; ++j) s[4 * j + 2 * h] *= f, s[4 * j + 2 * h + 1] *= f;
    e_row[h] = e;
  }
};

// S^T 2^-e <- e^G_C S^T 2^-e + U^T Kr^T, with P^T += U^T M^T beside it: the state's decay, then one
// m64n192 wgmma a k-step (A = U^T; B = M's 64 rows then Kr^T's 128, `d_mkr`). The step's update,
// and a pair's catch-up on the other block's chunk (there into an accumulator nobody reads).
__device__ __forceinline__ void decay_and_update(float (&s)[64], float (&pacc)[32], uint32_t (&ua)[4][4], const float* decay, int t,
                                                 uint64_t d_mkr) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 d = *reinterpret_cast<const float2*>(decay + 8 * j + 2 * t);
    s[4 * j] *= d.x, s[4 * j + 1] *= d.y, s[4 * j + 2] *= d.x, s[4 * j + 3] *= d.y;
  }
  ptx::fence_operands(ua);
  ptx::fence_operands(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16_pair<64, 128>(pacc, s, ua[ks], ptx::smem_matrix_desc_advance(d_mkr, 256 * ks));
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::fence_operands(s);
  ptx::fence_operands(pacc);
}

// A pair's hand-over (fused_config.h, kSmemPeerIn, PeerIn's layout): this block's receive region
// and barrier, and the other block's (shared::cluster addresses). The owner of chunk c sends Kr^T
// and e^G_C once its operand stage is complete (send_kr, beside its step's first products), then
// U^T and the rows' scales (send_u), and every math thread arrives once on the other block's
// barrier (256 a phase), which releases all of that thread's stores of the chunk. The other block
// applies the chunk's update to its own copy of the state before its next step (catch_up).
// One buffer, without a barrier of its own for its reuse: a block writes chunk c's hand-over in
// its step c, after it has applied chunk c - 1, whose hand-over the other block sent after it had
// applied chunk c - 2 (its wgmma waited for), the buffer's previous use. The order passes through
// the barrier's release and acquire.
struct PeerLink {
  uint8_t* buf;
  uint64_t* bar;
  uint32_t peer_buf, peer_bar;
  // Kr^T (16 KB) and e^G_C (512 B) of the chunk into the other block's buffer: a math thread's four
  // and (threads 0 .. 31) one more 16-byte pieces, copied as they lie.
  __device__ void send_kr(const MathLane& L, const Regions& R) const {
    const uint32_t n = static_cast<uint32_t>(L.thread());
    const uint32_t kr = peer_buf + PeerIn::kKr;
    const uint4* src = reinterpret_cast<const uint4*>(R.krt);
    static_assert(kKrTBytes == 4 * 16 * kMathThreads && kD * 4 == 16 * 32, "four pieces a thread, and 32 of e^G_C");
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::st_cluster_v4(kr + 16 * (kMathThreads * i + n), src[kMathThreads * i + n]);
    if (n < 32) ptx::st_cluster_v4(peer_buf + PeerIn::kDecay + 16 * n, reinterpret_cast<const uint4*>(R.f(Small::kDecay))[n]);
  }
  // The identity update (U^T and Kr^T zero, e^G_C one, the scales zero as load_state's), for
  // catch_up before block 0's first chunk; by every thread before the cluster's first barrier.
  __device__ void clear() const {
    for (uint32_t i = threadIdx.x; i < PeerIn::kDecay / 16; i += kThreads) reinterpret_cast<uint4*>(buf)[i] = make_uint4(0u, 0u, 0u, 0u);
    if (threadIdx.x < kD) reinterpret_cast<float*>(buf + PeerIn::kDecay)[threadIdx.x] = 1.f;
    ptx::fence_proxy_async_shared();  // Kr^T's zeros are read by wgmma
  }
  // U^T's fp16 A fragments and the rows' scales, then the arrival that releases them with send_kr's.
  __device__ void send_u(const MathLane& L, const uint32_t (&ua)[4][4], const StateRows& S) const {
    const uint32_t n = static_cast<uint32_t>(L.thread());
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::st_cluster_v4(peer_buf + PeerIn::kU + 16 * (kMathThreads * ks + n), make_uint4(ua[ks][0], ua[ks][1], ua[ks][2], ua[ks][3]));
    ptx::st_cluster_v2(peer_buf + PeerIn::kE + 8 * n, make_int2(S.e_row[0], S.e_row[1]));
    ptx::fence_proxy_async_shared_cluster();  // Kr^T is read by the other block's wgmma
    ptx::mbarrier_arrive_remote_release(peer_bar);
  }
  // The other block's last chunk (the hand-over of this parity) on this block's copy of S^T, as its
  // owner did it (step_operands' rescale, then step's decay and update): S^T 2^-e <- e^G_C S^T 2^-e
  // + U^T Kr, e the owner's new scales; then the scales are the owner's.
  // Before the block's first chunk there is nothing to wait for: block 0 applies the identity its
  // buffer starts with (clear), so that the wgmma is not in a branch (there ptxas serialized the
  // kernel's wgmma for want of registers).
  __device__ void catch_up(const MathLane& L, bool wait, uint32_t parity, StateRows& S) const {
    if (wait) {
      ptx::mbarrier_wait_parity<true>(bar, parity);
      ptx::fence_proxy_async_shared();  // Kr^T, written by the other block's stores, read by wgmma
    }
    const uint32_t n = static_cast<uint32_t>(L.thread());
    uint32_t ua[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint4 x = reinterpret_cast<const uint4*>(buf + PeerIn::kU)[kMathThreads * ks + n];
      ua[ks][0] = x.x, ua[ks][1] = x.y, ua[ks][2] = x.z, ua[ks][3] = x.w;
    }
    const int2 e = reinterpret_cast<const int2*>(buf + PeerIn::kE)[n];
    S.set_scale(0, e.x);
    S.set_scale(1, e.y);
    float (&s)[64] = S.s;
    // The owner's instruction (m64n192, M's 64 rows before Kr^T), so that both copies stay the
    // same bits: here 8 KB of U^T's place stand in for M.
    static_assert(PeerIn::kKr >= tile_offset(kC, 0, kC), "64 rows of anything before Kr^T");
    float unused[32] = {};
    ptx::fence_operands(unused);
    decay_and_update(s, unused, ua, reinterpret_cast<const float*>(buf + PeerIn::kDecay), L.t,
                     ptx::smem_matrix_desc(buf + PeerIn::kKr - tile_offset(kC, 0, kC), 128, tile_stride_bytes(kC)));
  }
};

// Form::kSplitShared: a segment's B and A runs, the two blocks of a cluster, each prepare every
// other chunk and hand the other their operand stage, Kr^T and e^G_C (64.5 KB, as they lie) once it
// is complete; each steps every chunk on its own state. The receive region is the second input
// stage's place (the Small arrays hold e^G_C and the barriers): the sender's 128 prep threads arrive
// once a chunk on the receiver's `full` barrier (releasing their stores), the receiver's 256 math
// threads once on the sender's `empty` barrier after their step's last wgmma has read the region, and
// the sender waits for that before it writes the region again (one chunk in flight each way).
struct OperandShare {
  uint64_t* full;
  uint64_t* empty;
  uint32_t peer_buf, peer_decay, peer_full, peer_empty;
  // The prep warpgroup, after chunk c's operands are complete: this block's k-th hand-over.
  __device__ void send(int k, const uint8_t* smem, const uint8_t* small) const {
    if (k > 0) ptx::mbarrier_wait_parity<true>(empty, static_cast<uint32_t>(k - 1) & 1u);
    const uint32_t n = threadIdx.x;  // a prep thread
    static_assert(kSmemKrT == kSmemOp + OpStage::kBytes && kInBytes % (16 * kPrepThreads) == 0 && kD * 4 <= 16 * kPrepThreads,
                  "the operand stage and Kr^T in one piece, whole 16-byte pieces a thread");
    const uint4* src = reinterpret_cast<const uint4*>(smem + kSmemOp);
#pragma unroll 4
    for (uint32_t i = 0; i < kInBytes / 16 / kPrepThreads; ++i) ptx::st_cluster_v4(peer_buf + 16 * (kPrepThreads * i + n), src[kPrepThreads * i + n]);
    if (n < kD * 4 / 16) ptx::st_cluster_v4(peer_decay + 16 * n, reinterpret_cast<const uint4*>(small + Small::kDecay)[n]);
    ptx::fence_proxy_async_shared_cluster();  // read by the other block's wgmma
    ptx::mbarrier_arrive_remote_release(peer_full);
  }
  // The math threads, before stepping on the k-th chunk received.
  __device__ void wait(int k) const {
    ptx::mbarrier_wait_parity<true>(full, static_cast<uint32_t>(k) & 1u);
    ptx::fence_proxy_async_shared();  // written by the other block's stores, read by wgmma
  }
  // After that step (its wgmma waited for): the region may be written again.
  __device__ void release() const { ptx::mbarrier_arrive_remote_release(peer_empty); }
};

// Element offsets of a row's pairs: the row's own, then 8 j (immediates: 32 addresses kept through
// the chunks would spill).
__device__ __forceinline__ int64_t state_row(const FusedParams& p, const Item& it, const MathLane& L, int h) {
  return (it.seq * p.num_heads + it.head) * int64_t{kD} * kD + int64_t{L.row(h)} * kD + 2 * L.t;
}

template <Form kForm>
__device__ __forceinline__ void load_state(const FusedParams& p, const Item& it, const MathLane& L, StateRows& S) {
  if constexpr (is_split(kForm)) {
    if (it.run > 0) {  // B_s from zero, A_s from the identity: S^T[j][k] = [j == k]
      const bool a_run = StateSplit::is_a_run(it.run);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int col = 8 * j + 2 * L.t;
          S.s[4 * j + 2 * h] = a_run && L.row(h) == col ? 1.f : 0.f;
          S.s[4 * j + 2 * h + 1] = a_run && L.row(h) == col + 1 ? 1.f : 0.f;
        }
      return;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = state_row(p, it, L, h);
    const float* f32 = static_cast<const float*>(p.initial_state) + row;
    const uint16_t* b16 = static_cast<const uint16_t*>(p.initial_state) + row;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float2 x = make_float2(0.f, 0.f);
      if (p.initial_state) x = p.initial_f32 ? *reinterpret_cast<const float2*>(f32 + 8 * j)
                                             : ptx::unpack_bf16x2(*reinterpret_cast<const uint32_t*>(b16 + 8 * j));
      S.s[4 * j + 2 * h] = x.x, S.s[4 * j + 2 * h + 1] = x.y;
    }
  }
}

template <Form kForm>
__device__ __forceinline__ void store_state(const FusedParams& p, const Item& it, const MathLane& L, const StateRows& S) {
  void* final_state = p.final_state;
  bool final_f32 = p.final_f32;
  if constexpr (is_split(kForm)) {  // S_0^T, B_s^T or A_s^T for the stitch (N = 1: it.seq = 0)
    if (kForm == Form::kSplitShared && it.run == 2 * p.split_runs.segments) return;  // segment 0's spare A run
    final_state = p.split_runs.run_final(it.run, int64_t{p.num_heads} * kD * kD);
    final_f32 = true;
  }
  if (!final_state) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = state_row(p, it, L, h);
    float* f32 = static_cast<float*>(final_state) + row;
    uint16_t* b16 = static_cast<uint16_t*>(final_state) + row;
    const float f = pow2(S.e_row[h]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float x0 = S.s[4 * j + 2 * h] * f, x1 = S.s[4 * j + 2 * h + 1] * f;
      if (final_f32) *reinterpret_cast<float2*>(f32 + 8 * j) = make_float2(x0, x1);
      else *reinterpret_cast<uint32_t*>(b16 + 8 * j) = ptx::pack_bf16x2(x0, x1);
    }
  }
}

// Chunk c's step, in two parts (step_operands, step): reads the operand stage, Kr^T and V (this
// warpgroup's box of the input stage), writes the out rows over V, then to device memory.

// The step's operands from registers: S^T and Y^T's accumulator (V^T), rescaled.
struct StepOperands {
  uint32_t sa[8][4];  // S^T 2^-e_row in fp16, A fragments of its 8 k-slices
  float y[32];        // V^T 2^-e_row: Y^T's accumulator
};

// The step's first part: V^T from its box, the rows' new scales, S^T rescaled and its fp16 A
// fragments. It reads nothing that chunk c's phases write (S^T is chunk c - 1's, V came by the
// copy engine), so the math warpgroups run it before the last phase barrier, where they would
// otherwise wait for the prep warpgroup's levels.
template <Form kForm>
__device__ __forceinline__ void step_operands(const Item& it, int c, const MathLane& L, const Regions& R, const InBarriers& bars,
                                              const PeerLink& link, StateRows& S, StepOperands& o) {
  const int t = L.t;
  const int count = it.count(c);
  float (&s)[64] = S.s;
  // Chunk c - 1, the other block's.
  if constexpr (kForm == Form::kPair) link.catch_up(L, c > 0, bars.order.handover_parity(c), S);
  if constexpr (kForm == Form::kSplitShared) {  // every chunk's v through the one stage, a box a warpgroup (the A run's: none)
    if (!StateSplit::is_a_run(it.run)) ptx::mbarrier_wait_parity(&bars.v[L.wg], static_cast<uint32_t>(c) & 1u);
  } else {
    ptx::mbarrier_wait_parity(&bars.v[bars.order.at(c).stage], bars.order.at(c).phase);
  }

  // V^T's pairs (rows v, tokens; bf16 as loaded, zero past the chunk's tokens) from this
  // warpgroup's box by ldmatrix.trans: vraw[ks][r] holds value row 16 warp + g + 8 (r & 1), tokens
  // 16 ks + 8 (r >> 1) + 2t, + 1 (the rows of matrix r: tokens 16 ks + 8 (r >> 1) + i, 8 values).
  uint8_t* vbox = R.in + kInV + L.wg * kBoxBytes;
  uint32_t vraw[4][4];
  float vmax[2] = {0.f, 0.f};
  // V's tokens; an A_s run's v is zero (its rows arrive all the same: one barrier protocol).
  const int vcount = is_split(kForm) && StateSplit::is_a_run(it.run) ? 0 : count;
  {
    const int m = L.lane / 8;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      ptx::ldmatrix_x4_trans(ptx::smem_addr(vbox + swizzled_offset(16 * ks + 8 * (m >> 1) + L.lane % 8, 16 * L.warp + 8 * (m & 1))), vraw[ks]);
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = 16 * ks + 8 * (r >> 1) + 2 * t;
      const uint32_t pair = vraw[ks][r] & (tok + 1 < vcount ? 0xffffffffu : tok < vcount ? 0x0000ffffu : 0u);
      vraw[ks][r] = pair;
      vmax[r & 1] = fmaxf(vmax[r & 1], fmaxf(fabsf(bf16_lo(pair)), fabsf(bf16_hi(pair))));
    }
  float scale_v[2];  // 2^-e_row after the rescale
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float smax = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) smax = fmaxf(smax, fmaxf(fabsf(s[4 * j + 2 * h]), fabsf(s[4 * j + 2 * h + 1])));
    float m = fmaxf(smax * pow2(S.e_row[h]), vmax[h]);  // true scale
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    // max in [4, 8) at the new scale; a row of zeros, Inf or NaN keeps its scale (branch-free: a
    // conditional rescale of all of S^T would cost ptxas a second copy of it).
    const bool rescale = m > 0.f && m < __int_as_float(0x7f800000);
    S.set_scale(h, rescale ? exponent_of(m) - 2 : S.e_row[h]);
    scale_v[h] = pow2(-S.e_row[h]);
  }
  // Y^T's accumulator starts at V^T 2^-e_row: element (row h, token 8 j + 2t + e) is D entry
  // 4 j + 2 h + e, with j = 2 ks + (r >> 1) and h = r & 1 for vraw[ks][r].
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e0 = 4 * (2 * ks + (r >> 1)) + 2 * (r & 1);
      o.y[e0] = bf16_lo(vraw[ks][r]) * scale_v[r & 1], o.y[e0 + 1] = bf16_hi(vraw[ks][r]) * scale_v[r & 1];
    }
  ptx::f16_a_from_d<8>(s, o.sa);
}

// Form::kSplitRun, runs after the first: O^T 2^e_row as fp32 rows of [total, H, 128] for the stitch
// (StateSplit::run_out), from the accumulator: element (row h, token 8 j + 2t + e) is pacc[4 j + 2 h + e].
// A warp's store: 8 value rows (32 bytes) of 4 tokens.
__device__ __forceinline__ void store_rows_f32(const FusedParams& p, const Item& it, int c, const MathLane& L, const StateRows& S,
                                               const float (&pacc)[32]) {
  float* rows = p.split_runs.run_out(it.run) + L.row(0);
  const int count = it.count(c);
  const float up0 = pow2(S.e_row[0]), up1 = pow2(S.e_row[1]);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 8 * j + 2 * L.t + e;
      if (tok < count) {
        float* r = rows + ((it.bos + int64_t{kC} * c + tok) * p.num_heads + it.head) * kD;
        r[0] = pacc[4 * j + e] * up0;
        r[8] = pacc[4 * j + 2 + e] * up1;
      }
    }
}

// The rest of chunk c's step, after the operand stage is complete: writes the out rows over V,
// then to device memory.
template <Form kForm>
__device__ __forceinline__ void step(const FusedParams& p, const Item& it, int c, const MathLane& L, const Regions& R, const PeerLink& link,
                                     StateRows& S, StepOperands& o) {
  const int t = L.t;
  const int count = it.count(c);
  float (&s)[64] = S.s;
  float (&y)[32] = o.y;
  uint32_t (&sa)[8][4] = o.sa;
  uint8_t* vbox = R.in + kInV + L.wg * kBoxBytes;
  uint8_t* op = R.op;
  const uint64_t d_kt = ptx::smem_matrix_desc(op + OpStage::kKt, 128, tile_stride_bytes(kD));
  const uint64_t d_qt = ptx::smem_matrix_desc(op + OpStage::kQt, 128, tile_stride_bytes(kD));
  const uint64_t d_mkr = ptx::smem_matrix_desc(op + OpStage::kM, 128, tile_stride_bytes(kC));  // M then Kr^T: one [192][64] B tile
  const uint64_t d_w = ptx::smem_matrix_desc(op + OpStage::kW, 128, tile_stride_bytes(kC));
  float u[32], pacc[32];
  FUSED_MARK(c, 11);
  constexpr bool kPair = kForm == Form::kPair;
  const bool hand_over = kPair && c + 1 < it.chunks();  // a pair: the other block takes the next chunk
  if (hand_over) link.send_kr(L, R);  // (while Y's wgmma run, its registers made ptxas serialize them)
  ptx::fence_operands(s);
  ptx::fence_operands(sa);
  ptx::fence_operands(y);
  ptx::wgmma_fence();
  uint32_t ya[4][4], ua[4][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(y, sa[ks], ptx::smem_matrix_desc_advance(d_kt, 256 * ks), true, true);
  ptx::wgmma_commit();
  // P beside Y; in a pair after U, which is on the pair's chain, and Kr^T goes over beside Y.
  auto issue_p = [&] {
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(pacc, sa[ks], ptx::smem_matrix_desc_advance(d_qt, 256 * ks), ks > 0);
    ptx::wgmma_commit();
  };
  if constexpr (!kPair) issue_p();
  ptx::wgmma_wait<kPair ? 0 : 1>();
  ptx::fence_operands(y);
  FUSED_MARK(c, 12);

  ptx::f16_a_from_d<4>(y, ya);
  ptx::fence_operands(ya);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<64>(u, ya[ks], ptx::smem_matrix_desc_advance(d_w, 256 * ks), ks > 0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  ptx::fence_operands(u);
  FUSED_MARK(c, 13);
  ptx::f16_a_from_d<4>(u, ua);
  if constexpr (kPair) {
    if (hand_over) link.send_u(L, ua, S);
    ptx::wgmma_fence();
    issue_p();
  }

  // The decay, before S^T goes back into an accumulator (beside Y and P, or beside U, ptxas spilled);
  // O's M U and the state's update share A = U^T.
  decay_and_update(s, pacc, ua, R.f(Small::kDecay), t, d_mkr);
  FUSED_MARK(c, 14);
  if constexpr (is_split(kForm)) {
    if (it.run > 0) {
      store_rows_f32(p, it, c, L, S, pacc);
      return;
    }
  }

  // out rows: O^T = P^T 2^e_row into this warpgroup's V box (read above) by stmatrix.trans (the
  // warp's 16 value rows x 16 tokens a store: token rows of 8 + 8 values), then to device memory.
  {
    const float up0 = pow2(S.e_row[0]), up1 = pow2(S.e_row[1]);
    const int m = L.lane / 8;
    const int vv = 16 * L.warp + 8 * (m & 1);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t r[4] = {ptx::pack_bf16x2(pacc[8 * q] * up0, pacc[8 * q + 1] * up0),
                             ptx::pack_bf16x2(pacc[8 * q + 2] * up1, pacc[8 * q + 3] * up1),
                             ptx::pack_bf16x2(pacc[8 * q + 4] * up0, pacc[8 * q + 5] * up0),
                             ptx::pack_bf16x2(pacc[8 * q + 6] * up1, pacc[8 * q + 7] * up1)};
      const int tok = 16 * q + 8 * (m >> 1) + L.lane % 8;
      ptx::stmatrix_x4_trans(ptx::smem_addr(vbox + swizzled_offset(tok, vv)), r);
    }
  }
  if (count == kC) {
    // A full chunk: one thread hands the box to the copy engine (after every writer's fence and the
    // warpgroup's barrier) and the warps go on; it waits for the store's reads before the box is
    // refilled (out_box_read). A partial chunk's rows past the sequence are another's: 16-byte
    // stores of the chunk's rows.
    ptx::fence_proxy_async_shared();
    named_sync(kMathBarrier + L.wg, 128);
    if (threadIdx.x % 128 == 0) {
      ptx::tensor_copy_3d_s2g(&p.out_tiles, vbox, kMathRows * L.wg, it.head, it.row(c));
      ptx::bulk_commit_group();
    }
    return;
  }
  named_sync(kMathBarrier + L.wg, 128);
  const int tid = threadIdx.x % 128;
  uint4 rows[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = 16 * i + tid / 8, chunk = tid % 8;
    rows[i] = *reinterpret_cast<const uint4*>(vbox + tok * 128 + ((chunk ^ (tok % 8)) * 16));
  }
  // The box's stores and loads, before the copy engine refills it. Fenced before the stores to
  // device memory: the fence (MEMBAR.ALL.CTA) would otherwise wait for them too.
  ptx::fence_proxy_async_shared();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = 16 * i + tid / 8, chunk = tid % 8;
    if (tok < count) {
      const int64_t row = it.bos + int64_t{kC} * c + tok;
      *reinterpret_cast<uint4*>(p.out + (row * p.num_heads + it.head) * kD + kMathRows * L.wg + 8 * chunk) = rows[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------

// The kernel's body: one block an item, or a pair's block (FusedParams::pair).
template <Form kForm>
__device__ __forceinline__ void fused_prefill(const FusedParams& p) {
  constexpr bool kPair = kForm == Form::kPair;
  constexpr bool kShared = kForm == Form::kSplitShared;
  constexpr bool kCluster = kPair || kShared;
  extern __shared__ __align__(1024) uint8_t smem[];  // the copy engine's swizzled boxes need 1024-byte alignment
  uint8_t* in_stages = smem + kSmemIn;
  uint8_t* small = smem + kSmemSmall;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(small + Small::kBarriers);
  const int rank = kCluster ? static_cast<int>(ptx::cluster_ctarank()) : 0;
  // A block's own chunks (a pair's or a shared split run's: every other one, through one input stage).
  const Schedule order{rank, kCluster ? 1 : 0, kCluster ? 1 : kInStages};
  const InBarriers bars{barriers, barriers + kInStages, order};
  auto regions = [&](int c) {
    return Regions{in_stages + order.at(c).stage * kInBytes, smem + kSmemOp, smem + kSmemKrT, smem + kSmemL, smem + kSmemZ, small};
  };
  uint64_t* peer_bar = reinterpret_cast<uint64_t*>(small + Small::kPeerIn);
  PeerLink link{smem + kSmemPeerIn, peer_bar, 0u, 0u};
  if constexpr (kPair) {
    link.peer_buf = ptx::map_to_rank(ptx::smem_addr(smem + kSmemPeerIn), static_cast<uint32_t>(rank ^ 1));
    link.peer_bar = ptx::map_to_rank(ptx::smem_addr(peer_bar), static_cast<uint32_t>(rank ^ 1));
  }
  uint64_t* empty_bar = reinterpret_cast<uint64_t*>(small + Small::kPeerEmpty);
  OperandShare share{peer_bar, empty_bar, 0u, 0u, 0u, 0u};
  if constexpr (kShared) {
    const uint32_t other = static_cast<uint32_t>(rank ^ 1);
    share.peer_buf = ptx::map_to_rank(ptx::smem_addr(smem + kSmemPeerIn), other);
    share.peer_decay = ptx::map_to_rank(ptx::smem_addr(small + Small::kPeerDecay), other);
    share.peer_full = ptx::map_to_rank(ptx::smem_addr(peer_bar), other);
    share.peer_empty = ptx::map_to_rank(ptx::smem_addr(empty_bar), other);
  }
  // A shared split run's step on the other block's chunk: its operands in the receive region, e^G_C
  // where the step reads it (Small::kDecay of a base moved to kPeerDecay), v in the one stage.
  const Regions peer_regions{in_stages, smem + kSmemPeerIn, smem + kSmemPeerIn + OpStage::kBytes, smem + kSmemL, smem + kSmemZ,
                         small + (Small::kPeerDecay - Small::kDecay)};

  Item it;
  const unsigned item = kCluster ? blockIdx.x / 2 : blockIdx.x;  // a pair: blocks 2i, 2i + 1
  it.head = static_cast<int>(item % p.num_heads);
  it.seq = item / p.num_heads;
  if (p.longest_first) {  // the sequence of rank it.seq: longest first, ties by index (SequenceTable::order_by_length's order)
    // The lengths in one round of loads, into the operand stage (first written in chunk 0's phase 2).
    static_assert(kMaxLongestFirstSeqs <= kThreads && kMaxLongestFirstSeqs * 8 <= OpStage::kBytes, "a length a thread");
    int64_t* lens = reinterpret_cast<int64_t*>(smem + kSmemOp);
    const int n = static_cast<int>(threadIdx.x), seqs = static_cast<int>(p.seqs.num_seqs);
    if (n < seqs) lens[n] = p.seqs.offset(n + 1) - p.seqs.offset(n);
    __syncthreads();
    if (n < seqs) {
      int64_t rank = 0;
      for (int m = 0; m < seqs; ++m) rank += lens[m] > lens[n] || (lens[m] == lens[n] && m < n);
      if (rank == it.seq) at<int64_t>(small, Small::kItemSeq) = n;
    }
    __syncthreads();
    it.seq = at<int64_t>(small, Small::kItemSeq);
  }
  [[maybe_unused]] int segment = 0;  // kSplitShared's (kSplitRun's follows from its run)
  if constexpr (kForm == Form::kSplitRun) {  // blocks (run, head), heads fastest; one sequence
    it.run = static_cast<int>(it.seq);
    it.seq = 0;
  }
  if constexpr (kShared) {  // clusters (segment, head): the B run, then the A run (segment 0: the spare one, 2S)
    segment = static_cast<int>(it.seq);
    it.seq = 0;
    it.run = rank == 0 ? (segment == 0 ? 0 : 2 * segment - 1) : (segment == 0 ? 2 * p.split_runs.segments : 2 * segment);
  }
  int64_t eos;
  p.seqs.bounds(it.seq, it.bos, eos);
  if constexpr (is_split(kForm)) {  // the run's segment, in whole chunks
    StateSplit::segment_tokens(it.bos, eos, p.split_runs.segments, kShared ? segment : StateSplit::segment_of(it.run), kC, it.bos, eos);
  }
  it.len = eos - it.bos;
  const int chunks = it.chunks();

  if (threadIdx.x == 0) {
    for (int s = 0; s < 2 * kInStages; ++s) ptx::mbarrier_init(&barriers[s], 1);
    if (kPair) ptx::mbarrier_init(peer_bar, kMathThreads);
    if (kShared) {
      ptx::mbarrier_init(peer_bar, kPrepThreads);
      ptx::mbarrier_init(empty_bar, kMathThreads);
    }
    ptx::fence_mbarrier_init();
    // The first chunks' inputs: q, k, g a stage each, v of all but the last (prep_rest loads the others).
    for (int n = 0; n < order.stages && order.chunk(n) < chunks; ++n) load_qkg(p, it, order.chunk(n), in_stages, bars);
    for (int n = 0; n < order.stages - 1 && order.chunk(n) < chunks; ++n) load_v(p, it, order.chunk(n), in_stages, bars);
    if (kPair && p.pair_prefetch && order.chunk(1) < chunks) prefetch_inputs(p, it, order.chunk(1));
    if (kShared && !StateSplit::is_a_run(it.run) && chunks > 0) {  // chunk 0's v, a box a math warpgroup
      for (int wg = 0; wg < 2; ++wg) load_v_box(p, it, 0, wg, in_stages, bars);
    }
  }
  const float neg_expA_log2e = -ptx::kLog2e * expf(p.A_log[it.head]);
  // The gate's bias times the gate's factor: one FFMA a gate where an add and a multiply were.
  if (threadIdx.x < kD) reinterpret_cast<float*>(small + Small::kDtBias)[threadIdx.x] = neg_expA_log2e * p.dt_bias[it.head * kD + threadIdx.x];
  // M's and W's blocks above the diagonal: zero once (nothing writes them).
  for (int i = static_cast<int>(threadIdx.x); i < kC * kC / 2; i += kThreads) {
    const int r = i / (kC / 2), col = 2 * (i % (kC / 2));
    if (col / kBlock > r / kBlock) {
      at<uint32_t>(smem + kSmemOp, OpStage::kM + tile_offset(r, col, kC)) = 0u;
      at<uint32_t>(smem + kSmemOp, OpStage::kW + tile_offset(r, col, kC)) = 0u;
    }
  }
  if constexpr (kCluster) {
    if (kPair && rank == 0) link.clear();
    ptx::cluster_sync();  // the other block's barriers initialised before this one arrives on them
  }
  else __syncthreads();

  const PrepWarp L0 = PrepWarp::of_thread();
  if (threadIdx.x < kPrepThreads) {
    set_max_registers_dec<kPrepRegs>();
    const uint16_t* head_beta = it.len > 0 ? p.beta.row(it.bos, it.head) : nullptr;
    uint32_t beta = beta_bits(p, it, head_beta, order.first, threadIdx.x);
    [[maybe_unused]] int sends = 0;  // kShared: the operands handed over so far
    for (int c = order.first; c < chunks; c = order.ahead(c, 1)) {
      const Regions R = regions(c);
      const PrepWarp L = L0.laundered();
      FUSED_MARK(c, 0);
      ptx::mbarrier_wait_parity(&bars.qkg[order.at(c).stage], order.at(c).phase);
      FUSED_MARK(c, 1);
      // A pair's block: the chunk after the next one into the L2 (the next one's went a chunk ago).
      if (kPair && p.pair_prefetch && threadIdx.x == 0 && order.ahead(c, 2) < chunks) prefetch_inputs(p, it, order.ahead(c, 2));
      if (it.count(c) < kC) clear_padding_rows(R, it.count(c));
      chunk_scalars(p, it, c, beta, L, R);
      FUSED_MARK(c, 2);
      named_arrive(kInputsBarrier, kThreads);
      beta = beta_bits(p, it, head_beta, order.ahead(c, 1), threadIdx.x);
      Frag16 Ld = {}, Md = {};
      elementwise_pass(p, L, R, neg_expA_log2e, 0, p.split[0], Ld, Md);
      prep_rest<true, !kShared>(p, it, c, L, R, in_stages, bars, Ld, Md);
      operands_ready(c);
      // The stage's q, k, g are free: the block's chunk a round of stages on comes in (the fence in
      // prep_rest ordered the stores).
      if (threadIdx.x == 0 && order.ahead(c, order.stages) < chunks) load_qkg(p, it, order.ahead(c, order.stages), in_stages, bars);
      if constexpr (kShared) share.send(sends++, smem, small);
    }
  } else {
    set_max_registers_inc<kMathRegs>();
    const int tid = threadIdx.x - kPrepThreads;
    const MathLane M{tid / 128, (tid / 32) % 4, tid % 32, (tid % 32) / 4, tid % 4};
    StateRows S;
    load_state<kForm>(p, it, M, S);
    if constexpr (kShared) {
      // Every chunk in order, each stepped once its operands are complete; a block prepares its next
      // own chunk before it steps the other's chunk before that one (the prep needs no state), so
      // that each block's time a pair of chunks is one prep and two steps.
      int received = 0;
      auto step_chunk = [&](int c, const Regions& R) {
        const MathLane ML = M.laundered();
        StepOperands o;
        step_operands<kForm>(it, c, ML, R, bars, link, S, o);
        step<kForm>(p, it, c, ML, R, link, S, o);
        // The B run's next v into this warpgroup's box, once its rows are read (and run 0's out rows stored).
        if (!StateSplit::is_a_run(it.run) && c + 1 < chunks) {
          named_sync(kMathBarrier + ML.wg, 128);
          if (threadIdx.x % 128 == 0) {
            ptx::bulk_wait_group_read<0>();
            load_v_box(p, it, c + 1, ML.wg, in_stages, bars);
            // The one after it into the L2: an own chunk's v is requested right before its step.
            if (c + 2 < chunks) ptx::tensor_prefetch_3d_l2(&p.v_tiles, 64 * ML.wg, it.head, it.row(c + 2));
          }
        }
      };
      auto step_received = [&](int c) {
        share.wait(received++);
        step_chunk(c, peer_regions);
        share.release();
      };
      for (int c = order.first; c < chunks; c = order.ahead(c, 1)) {
        const Regions R = regions(c);
        const PrepWarp L = L0.laundered();
        named_sync(kInputsBarrier, kThreads);  // beta and the norms of chunk c
        ptx::mbarrier_wait_parity(&bars.qkg[order.at(c).stage], order.at(c).phase);
        Frag16 Ld = {}, Md = {};
        const int part = L.part();
        elementwise_pass(p, L, R, neg_expA_log2e, p.split[part - 1], part == kParts - 1 ? kChannelGroups : p.split[part], Ld, Md);
        prep_rest<false>(p, it, c, L, R, in_stages, bars, Ld, Md);  // (the math instance loads no v)
        operands_ready(c);
        if (c > 0) step_received(c - 1);
        step_chunk(c, R);
      }
      if (chunks > 0 && ((chunks - 1) & 1) != rank) step_received(chunks - 1);
    }
    for (int c = order.first; c < chunks && !kShared; c = order.ahead(c, 1)) {
      const Regions R = regions(c);
      const PrepWarp L = L0.laundered();
      FUSED_MARK(c, 0);
      named_sync(kInputsBarrier, kThreads);  // beta and the norms of chunk c
      FUSED_MARK(c, 1);
      ptx::mbarrier_wait_parity(&bars.qkg[order.at(c).stage], order.at(c).phase);
      Frag16 Ld = {}, Md = {};
      const int part = L.part();  // 1 or 2: channel groups [split[part - 1], split[part] or 16)
      elementwise_pass(p, L, R, neg_expA_log2e, p.split[part - 1], part == kParts - 1 ? kChannelGroups : p.split[part], Ld, Md);
      prep_rest<false>(p, it, c, L, R, in_stages, bars, Ld, Md);
      const MathLane ML = M.laundered();
      StepOperands o;
      step_operands<kForm>(it, c, ML, R, bars, link, S, o);
      FUSED_WARP_MARK(c, 2);
      operands_ready(c);
      FUSED_WARP_MARK(c, 3);
      step<kForm>(p, it, c, ML, R, link, S, o);
      FUSED_MARK(c, 10);
    }
    // The block that ran the last chunk (block 0 of a pair where there is none) has the final state.
    if (rank == (chunks > 0 ? (chunks - 1) % 2 : 0) || !kPair) store_state<kForm>(p, it, M.laundered(), S);
    out_box_read();
  }
  // Neither block of a cluster leaves while the other may still write its shared memory.
  if constexpr (kCluster) ptx::cluster_sync();
}

__global__ void __launch_bounds__(kThreads, 1) fused_prefill_kernel(const __grid_constant__ FusedParams p) { fused_prefill<Form::kOne>(p); }
// A pair: blocks 2i and 2i + 1 (one cluster) take item i.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) fused_prefill_pair_kernel(const __grid_constant__ FusedParams p) {
  fused_prefill<Form::kPair>(p);
}
// The split pass's runs: block i takes run i / H of head i % H (FusedParams::split_runs).
__global__ void __launch_bounds__(kThreads, 1) fused_prefill_split_kernel(const __grid_constant__ FusedParams p) {
  fused_prefill<Form::kSplitRun>(p);
}
// The split pass's runs a segment's two a cluster (FusedParams::split_shared): blocks 2i, 2i + 1
// take segment i / H of head i % H.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) fused_prefill_split_shared_kernel(const __grid_constant__ FusedParams p) {
  fused_prefill<Form::kSplitShared>(p);
}

#ifdef FLASHKDA_FUSED_TIMING
// One thread prints every line, in order, once all the stamps are in (a printf a warpgroup and warp
// from the stamping threads came out incomplete: 3 of 15 lines in one run). Stamps of a launch
// whose block 0 had no chunk kTimedChunk stay zero (cleared after each print).
__global__ void fused_timing_print_kernel() {
  if (g_fused_marks[0][0] == 0) return;
  // From the prep warpgroup's loop top; each name is a phase's end or a barrier passed. Only the
  // prep warpgroup stamps `scalars`, only the math ones `step`: the other value is meaningless.
  const long long o = g_fused_marks[0][0];
  for (int wg = 0; wg < kThreads / 128; ++wg) {
    const long long* m = g_fused_marks[wg];
    printf("fused timing, chunk %d, warpgroup %d (cycles from the prep loop top): top %lld inputs %lld scalars %lld pass %lld "
           "A %lld phase2 %lld B %lld phase3 %lld phase4 %lld C %lld step %lld (in it: rescaled %lld Y %lld U %lld S %lld)\n",
           kTimedChunk, wg, m[0] - o, m[1] - o, m[2] - o, m[3] - o, m[4] - o, m[5] - o, m[6] - o, m[7] - o, m[8] - o, m[9] - o,
           m[10] - o, m[11] - o, m[12] - o, m[13] - o, m[14] - o);
  }
  for (int warp = 0; warp < kWarps; ++warp) {
    const long long* w = g_fused_warp_marks[warp];
    printf("fused timing, chunk %d, warp %d, phase 4 (cycles from the prep loop top; prep: open, level 1, barrier, level 2, "
           "barrier, end; math: open, tiles, step_operands, closed): %lld %lld %lld %lld %lld %lld\n",
           kTimedChunk, warp, w[0] - o, w[1] - o, w[2] - o, w[3] - o, w[4] - o, w[5] - o);
  }
  for (int wg = 0; wg < kThreads / 128; ++wg)
    for (int i = 0; i < kMarks; ++i) g_fused_marks[wg][i] = 0;
  for (int warp = 0; warp < kWarps; ++warp)
    for (int i = 0; i < kWarpMarks; ++i) g_fused_warp_marks[warp][i] = 0;
}
#endif

}  // namespace

void launch_fused(const FusedParams& p, cudaStream_t stream) {
  const bool split = p.split_runs.segments > 0;
  if (split && (p.pair || p.longest_first || p.seqs.num_seqs != 1))
    fail(ErrorCode::kInternal, "the fused split pass runs one sequence, one block a run and head");
  const int64_t blocks = !split ? p.seqs.num_seqs * p.num_heads * (p.pair ? 2 : 1)
                        : (2 * int64_t{p.split_runs.segments} - (p.split_shared ? 0 : 1)) * p.num_heads;
  if (blocks == 0) return;
  if (blocks > INT32_MAX) fail(ErrorCode::kUnsupported, "q: the fused prefill takes fewer than 2^31 blocks, got ", blocks);
  if (p.longest_first && p.seqs.num_seqs > kMaxLongestFirstSeqs)
    fail(ErrorCode::kInvalidArgument, "the fused prefill ranks at most ", kMaxLongestFirstSeqs, " sequences, got ", p.seqs.num_seqs);
  if (!valid_split(p.split[0], p.split[1]))
    fail(ErrorCode::kInvalidArgument, "FLASHKDA_FUSED_SPLIT: expected 0 < a < b < ", kChannelGroups, ", got ", p.split[0], ",", p.split[1]);
  // The shared-memory limit, raised once per device the caller uses and kernel it launches.
  static PerDeviceOnce raised[4];  // [form]
  const int form = split ? (p.split_shared ? 3 : 2) : p.pair ? 1 : 0;
  constexpr decltype(&fused_prefill_kernel) kernels[4] = {fused_prefill_kernel, fused_prefill_pair_kernel, fused_prefill_split_kernel,
                                                          fused_prefill_split_shared_kernel};
  const auto kernel = kernels[form];
  raised[form].run("raising the fused prefill kernel's shared-memory limit", [kernel] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  });
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "launching the fused prefill kernel failed: ", cudaGetErrorString(err));
#ifdef FLASHKDA_FUSED_TIMING
  fused_timing_print_kernel<<<1, 1, 0, stream>>>();
#endif
}

}  // namespace flashkda::gpu
