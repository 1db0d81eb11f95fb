// The fused chunk-64 prefill (layouts and roles: fused_config.h). One block a (sequence, head):
// warpgroup 0 (prep) turns each chunk's q, k, g, v, beta into the operands of the chunk form in
// shared memory; warpgroups 1 and 2 (math) run the state chain on wgmma, each owning 64 value
// rows of S^T in fp32 registers. Chunk c's step overlaps chunk c + 1's prep through two operand
// stages; nothing goes through device memory but the inputs, out and the states.
//
// The chunk form (docs/contract.md) with Wk = W Kt:
//   U = W V - Wk S,   O = Qt S + M U,   S' = Diag(exp(G_C)) S + Kr^T U
// and on the value rows v of S^T, with a power-of-two scale 2^e_v per row (S^ = S 2^-e_v, set
// each chunk so that max(|S_v|, |V_v|) 2^-e_v lies in [4, 8): fp16 operands never overflow):
//   U^T = V^T W^T - S^T Wk^T      one m64n64 accumulator: 4 + 8 wgmma (the second with A negated)
//   P^T = S^T Qt^T                8 wgmma;  then P^T += U^T M^T, 4 wgmma: O^T = P^T 2^e_v
//   S^T = S^T D + U^T Kr          4 wgmma m64n128k16
//
// Prep, for one chunk, warp b owning token block b (tokens 16 b .. 16 b + 15) and lane (g, t)
// tokens g, g + 8 of it and channels 8 kk + 2t, + 1 (kk < 16): the fragment layout of the block's
// own products, so that the diagonal blocks of L and M come from the lane's registers.
//   1. norms of q and k (a quad's partial sums), the gate a and G - R_b, the running sum from the
//      block's start (R_b: G before the block), by a scan across the lanes of a quad column;
//   2. L_bb, M_bb in tf32 (operands up to e^80); the fp16 products kept in place of the inputs:
//      q -> scale q^ e^(G - R_b), k -> k^ e^(G - R_b), g -> k^ e^(T_b - G) (T_b: the block's sum);
//   3. the block sums exchanged, a table of per-channel factors (e^R_b, e^(G_C - R_(b+1)),
//      e^(R_b - R_(j+1))) from them; Qt and Kt^T written;
//   4. L_bj, M_bj for j < b in fp16 (B side k^ e^(R_b - G_j) = the g products times e^(R_b - R_(j+1))),
//      the six blocks dealt over the four warps;
//   5. (I + L)^-1 by blocks: the diagonal ones by right-looking substitution in fp32, then the
//      blocks below by levels (X_bj = -X_bb sum_m L_bm X_mj) on tf32 mma; W = X Diag(beta);
//   6. Wk = W Kt (fp16 mma), then Kr^T over Kt^T's place.
#include <cuda_runtime.h>

#include "common/fail.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/fused_config.h"
#include "gpu/prefill/kernels.h"
#include "gpu/prefill/stage_ring.cuh"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/fast_math.cuh"
#include "gpu/ptx/mma.cuh"
#include "gpu/ptx/wgmma_f16.cuh"

namespace flashkda::gpu {
namespace {

using namespace fused;
// The operand stages between the prep warpgroup (each of its threads writes and arrives; its
// leader adds V's copy) and the math warpgroups (each thread releases).
using OpRing = state_pass::StageRing<kOpStages>;

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

// Named barriers: 0 is __syncthreads; the prep warpgroup and each math warpgroup have their own.
constexpr int kPrepBarrier = 1, kMathBarrier = 2;
__device__ __forceinline__ void warpgroup_barrier(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float2 unpack_f16x2(uint32_t x) {
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
}
template <typename T>
__device__ __forceinline__ T& at(uint8_t* base, uint32_t offset) {
  return *reinterpret_cast<T*>(base + offset);
}

__device__ __forceinline__ void prefetch_tile_l2(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(map), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
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
  __device__ int chunks() const { return static_cast<int>((len + kC - 1) / kC); }
};

// ---------------------------------------------------------------------------------------------
// Prep (warpgroup 0)
// ---------------------------------------------------------------------------------------------

struct PrepLane {
  int warp, lane, g, t;
  __device__ int tok0() const { return kBlock * warp + g; }  // this lane's tokens: tok0, tok0 + 8
};

// One chunk's prep into operand stage `op`; `in` holds its q, k, g. Returns when the stage is full.
__device__ __forceinline__ void prep_chunk(const FusedParams& p, const PrepLane& L, uint8_t* in, uint8_t* op, uint8_t* Lblk,
                           uint8_t* small, int count, float neg_expA_log2e) {
  const int warp = L.warp, lane = L.lane, g = L.g, t = L.t;
  const int i0 = L.tok0(), i1 = i0 + 8;  // chunk rows of this lane's tokens
  const bool v0 = i0 < count, v1 = i1 < count;
  const float* dtb = reinterpret_cast<const float*>(small + Small::kDtBias);
  const float* beta = reinterpret_cast<const float*>(small + Small::kBeta);
  float* totals = reinterpret_cast<float*>(small + Small::kTotals);

  // 1a. 1 / ||q||, 1 / ||k|| of the two tokens: the lane's 32 channels, then the quad.
  float sq0 = 0.f, sq1 = 0.f, sk0 = 0.f, sk1 = 0.f;
#pragma unroll
  for (int kk = 0; kk < 16; ++kk) {
    const int c = 8 * kk + 2 * t;
    const uint32_t q0 = at<uint32_t>(in, kInQ + swizzled_offset(i0, c)), q1 = at<uint32_t>(in, kInQ + swizzled_offset(i1, c));
    const uint32_t k0 = at<uint32_t>(in, kInK + swizzled_offset(i0, c)), k1 = at<uint32_t>(in, kInK + swizzled_offset(i1, c));
    sq0 = fmaf(bf16_lo(q0), bf16_lo(q0), fmaf(bf16_hi(q0), bf16_hi(q0), sq0));
    sq1 = fmaf(bf16_lo(q1), bf16_lo(q1), fmaf(bf16_hi(q1), bf16_hi(q1), sq1));
    sk0 = fmaf(bf16_lo(k0), bf16_lo(k0), fmaf(bf16_hi(k0), bf16_hi(k0), sk0));
    sk1 = fmaf(bf16_lo(k1), bf16_lo(k1), fmaf(bf16_hi(k1), bf16_hi(k1), sk1));
  }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    sq0 += __shfl_xor_sync(0xffffffffu, sq0, m), sq1 += __shfl_xor_sync(0xffffffffu, sq1, m);
    sk0 += __shfl_xor_sync(0xffffffffu, sk0, m), sk1 += __shfl_xor_sync(0xffffffffu, sk1, m);
  }
  // q^ scale folded in; padding tokens contribute nothing (their q, k read as zero below).
  const float rq0 = p.scale * rsqrtf(sq0 + 1e-6f), rq1 = p.scale * rsqrtf(sq1 + 1e-6f);
  const float rk0 = rsqrtf(sk0 + 1e-6f), rk1 = rsqrtf(sk1 + 1e-6f);
  const float lb_log2e = ptx::kLog2e * p.lower_bound;

  // 1b-2. Gate, block-relative G (log2 units), the diagonal products and the in-place fp16 products.
  float Ld[2][4] = {}, Md[2][4] = {};  // C fragments of L_bb, M_bb: n-tile = token half
#pragma unroll 1
  for (int kk = 0; kk < 16; ++kk) {
    const int c = 8 * kk + 2 * t;
    const uint32_t oq0 = kInQ + swizzled_offset(i0, c), oq1 = kInQ + swizzled_offset(i1, c);
    const uint32_t ok0 = kInK + swizzled_offset(i0, c), ok1 = kInK + swizzled_offset(i1, c);
    const uint32_t og0 = kInG + swizzled_offset(i0, c), og1 = kInG + swizzled_offset(i1, c);
    const uint32_t gr0 = at<uint32_t>(in, og0), gr1 = at<uint32_t>(in, og1);
    const float b0 = dtb[c], b1 = dtb[c + 1];
    auto gate = [&](float x, float bias, bool valid) {  // a log2(e): lower_bound sigmoid(exp(A_log) (x + bias))
      return valid ? lb_log2e * ptx::rcp_ftz(1.0f + ptx::exp2_ftz(neg_expA_log2e * (x + bias))) : 0.0f;
    };
    // [token half][channel]: inclusive scan over the 8 lanes g of a quad column, then half 1 adds half 0's sum.
    float G[2][2] = {{gate(bf16_lo(gr0), b0, v0), gate(bf16_hi(gr0), b1, v0)},
                     {gate(bf16_lo(gr1), b0, v1), gate(bf16_hi(gr1), b1, v1)}};
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
    if (g == 0) *reinterpret_cast<float2*>(totals + warp * kD + c) = make_float2(tot[0], tot[1]);
    const uint32_t q0 = at<uint32_t>(in, oq0), q1 = at<uint32_t>(in, oq1);
    const uint32_t k0 = at<uint32_t>(in, ok0), k1 = at<uint32_t>(in, ok1);
    // [half][channel] k^, scale q^ (zero for padding tokens, whatever their rows hold)
    const float kh[2][2] = {{v0 ? bf16_lo(k0) * rk0 : 0.f, v0 ? bf16_hi(k0) * rk0 : 0.f},
                            {v1 ? bf16_lo(k1) * rk1 : 0.f, v1 ? bf16_hi(k1) * rk1 : 0.f}};
    const float qh[2][2] = {{v0 ? bf16_lo(q0) * rq0 : 0.f, v0 ? bf16_hi(q0) * rq0 : 0.f},
                            {v1 ? bf16_lo(q1) * rq1 : 0.f, v1 ? bf16_hi(q1) * rq1 : 0.f}};
    float ka[2][2], qa[2][2], kb[2][2], kr[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        const float e = ptx::exp2_ftz(G[h][ch]), e_inv = ptx::exp2_ftz(-G[h][ch]);
        ka[h][ch] = kh[h][ch] * e, qa[h][ch] = qh[h][ch] * e, kb[h][ch] = kh[h][ch] * e_inv;
        kr[h][ch] = kh[h][ch] * ptx::exp2_ftz(tot[ch] - G[h][ch]);
      }
    // tf32 m16n8k8 with k-slot t = channel c, t + 4 = c + 1 (mma.cuh): A rows = tokens g, g + 8.
    const uint32_t a_k[4] = {__float_as_uint(ptx::tf32_operand(ka[0][0])), __float_as_uint(ptx::tf32_operand(ka[1][0])),
                             __float_as_uint(ptx::tf32_operand(ka[0][1])), __float_as_uint(ptx::tf32_operand(ka[1][1]))};
    const uint32_t a_q[4] = {__float_as_uint(ptx::tf32_operand(qa[0][0])), __float_as_uint(ptx::tf32_operand(qa[1][0])),
                             __float_as_uint(ptx::tf32_operand(qa[0][1])), __float_as_uint(ptx::tf32_operand(qa[1][1]))};
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // B column g of n-tile n: token g + 8 n
      const float b_lo = ptx::tf32_operand(kb[n][0]), b_hi = ptx::tf32_operand(kb[n][1]);
      ptx::mma_tf32_1688(Ld[n], a_k, b_lo, b_hi);
      ptx::mma_tf32_1688(Md[n], a_q, b_lo, b_hi);
    }
    at<uint32_t>(in, ok0) = ptx::pack_f16x2(ka[0][0], ka[0][1]), at<uint32_t>(in, ok1) = ptx::pack_f16x2(ka[1][0], ka[1][1]);
    at<uint32_t>(in, oq0) = ptx::pack_f16x2(qa[0][0], qa[0][1]), at<uint32_t>(in, oq1) = ptx::pack_f16x2(qa[1][0], qa[1][1]);
    at<uint32_t>(in, og0) = ptx::pack_f16x2(kr[0][0], kr[0][1]), at<uint32_t>(in, og1) = ptx::pack_f16x2(kr[1][0], kr[1][1]);
  }
  // Blocks of L (fp32, beta_i folded) into their region, of M (fp16) into the stage, as computed.
  const float bi[2] = {beta[i0], beta[i1]};
  auto put_block = [&](uint8_t* base, const float (&c)[2][4], int ib, int jb, bool strictly_lower, float sign) {
    // C fragments (rows g, g + 8 of block ib; columns 8 n + 2t, + 1 of block jb) as fp32 [16][16]
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = g + 8 * h, col = 8 * n + 2 * t + e;
          const bool keep = !strictly_lower || col < r;
          reinterpret_cast<float*>(base + lower_block(ib, jb))[r * kBlock + col] = keep ? sign * c[n][2 * h + e] : 0.f;
        }
  };
  auto put_m = [&](const float (&c)[2][4], int ib, int jb, bool diag) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h, col = 8 * n + 2 * t;
        const float x0 = (!diag || col <= r) ? c[n][2 * h] : 0.f, x1 = (!diag || col + 1 <= r) ? c[n][2 * h + 1] : 0.f;
        at<uint32_t>(op, OpStage::kM + tile_offset(kBlock * ib + r, kBlock * jb + col, kC)) = ptx::pack_f16x2(x0, x1);
      }
  };
  {
    float lb[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) lb[n][e] = Ld[n][e] * bi[e >> 1];
    put_block(Lblk, lb, warp, warp, true, 1.f);
    put_m(Md, warp, warp, true);
  }
  warpgroup_barrier(kPrepBarrier);  // totals, and every block's in-place products

  // 3. The per-channel factors (Small::kER ..), thread = channel; then Qt, Kt^T (into KrT's place)
  // and the decay.
  const float* eR = reinterpret_cast<const float*>(small + Small::kER);
  const float* eKr = reinterpret_cast<const float*>(small + Small::kEKr);
  const float* eGap = reinterpret_cast<const float*>(small + Small::kEGap);
  {
    const int c = threadIdx.x;  // prep threads 0 .. 127
    float T[kBlocks], R[kBlocks + 1] = {0.f};
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) T[b] = totals[b * kD + c], R[b + 1] = R[b] + T[b];
    float* w = reinterpret_cast<float*>(small);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      w[Small::kER / 4 + b * kD + c] = ptx::exp2_ftz(R[b]);
      w[Small::kEKr / 4 + b * kD + c] = ptx::exp2_ftz(R[kBlocks] - R[b + 1]);
    }
    w[Small::kEGap / 4 + 0 * kD + c] = ptx::exp2_ftz(R[2] - R[1]);
    w[Small::kEGap / 4 + 1 * kD + c] = ptx::exp2_ftz(R[3] - R[2]);
    w[Small::kEGap / 4 + 2 * kD + c] = ptx::exp2_ftz(R[3] - R[1]);
    reinterpret_cast<float*>(op + OpStage::kDecay)[c] = ptx::exp2_ftz(R[kBlocks]);
  }
  warpgroup_barrier(kPrepBarrier);
#pragma unroll
  for (int kk = 0; kk < 16; ++kk) {
    const int c = 8 * kk + 2 * t;
    const float2 e = *reinterpret_cast<const float2*>(eR + warp * kD + c);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = h ? i1 : i0;
      const float2 qa = unpack_f16x2(at<uint32_t>(in, kInQ + swizzled_offset(tok, c)));
      const float2 ka = unpack_f16x2(at<uint32_t>(in, kInK + swizzled_offset(tok, c)));
      at<uint32_t>(op, OpStage::kQt + tile_offset(tok, c, kD)) = ptx::pack_f16x2(qa.x * e.x, qa.y * e.y);
      at<__half>(op, OpStage::kKrT + tile_offset(c, tok, kC)) = __float2half_rn(ka.x * e.x);
      at<__half>(op, OpStage::kKrT + tile_offset(c + 1, tok, kC)) = __float2half_rn(ka.y * e.y);
    }
  }

  // 4. Off-diagonal blocks L_bj, M_bj (j < b), six of them dealt two, two, one, one to the warps:
  // fp16 m16n8k16, A = block b's fp16 products (lane pairs 2t and 8 + 2t of k-tile kt: channels
  // 16 kt + 2t, 16 kt + 8 + 2t), B = block j's g products times e^(R_b - R_(j+1)) per channel.
  constexpr int kPairs = 6;
  constexpr int kPairB[kPairs] = {1, 2, 3, 2, 3, 3}, kPairJ[kPairs] = {0, 1, 2, 0, 1, 0};
  for (int pair = warp; pair < kPairs; pair += kBlocks) {
    const int b = kPairB[pair], j = kPairJ[pair];
    const float* gap = b - j == 1 ? nullptr : eGap + (b == 2 ? 0 : j == 1 ? 1 : 2) * kD;  // e^(R_b - R_(j+1))
    const int r0 = kBlock * b + g, r1 = r0 + 8;
    float Lo[2][4] = {}, Mo[2][4] = {};
#pragma unroll 2
    for (int kt = 0; kt < 8; ++kt) {
      uint32_t ak[4], aq[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tok = (r & 1) ? r1 : r0, c = 16 * kt + 8 * (r >> 1) + 2 * t;
        ak[r] = at<uint32_t>(in, kInK + swizzled_offset(tok, c));
        aq[r] = at<uint32_t>(in, kInQ + swizzled_offset(tok, c));
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {  // B column g of n-tile n: token 16 j + 8 n + g of block j
        uint32_t bf[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int c = 16 * kt + 8 * hh + 2 * t;
          const uint32_t x = at<uint32_t>(in, kInG + swizzled_offset(kBlock * j + 8 * n + g, c));
          if (gap) {
            const float2 d = *reinterpret_cast<const float2*>(gap + c), y = unpack_f16x2(x);
            bf[hh] = ptx::pack_f16x2(y.x * d.x, y.y * d.y);
          } else {
            bf[hh] = x;  // adjacent blocks: e^0
          }
        }
        ptx::mma_f16_16816(Lo[n], ak, bf[0], bf[1]);
        ptx::mma_f16_16816(Mo[n], aq, bf[0], bf[1]);
      }
    }
    const float bb[2] = {beta[r0], beta[r1]};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) Lo[n][e] *= bb[e >> 1];
    put_block(Lblk, Lo, b, j, false, 1.f);
    put_m(Mo, b, j, false);
  }
  // Zero M's blocks above the diagonal (the stage is reused).
  for (int jb = warp + 1; jb < kBlocks; ++jb)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        at<uint32_t>(op, OpStage::kM + tile_offset(kBlock * warp + g + 8 * h, kBlock * jb + 8 * n + 2 * t, kC)) = 0u;
  warpgroup_barrier(kPrepBarrier);  // the k tile's products read by every warp: free for X

  // 5. X_bb = (I + L_bb)^-1 by forward substitution, lane j < 16 computing column j in fp32.
  uint8_t* Xblk = in + kInK;
  {
    // Right-looking: once x_m is known it leaves every later row at once, so the dependent chain
    // is 16 FMAs long (a left-looking dot product per row made it 120).
    const float* Lbb = reinterpret_cast<const float*>(Lblk + lower_block(warp, warp));
    float x[kBlock];
    const int j = lane & 15;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) x[i] = i == j ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < kBlock; ++m)
#pragma unroll
      for (int i = m + 1; i < kBlock; ++i) x[i] = fmaf(-Lbb[i * kBlock + m], x[m], x[i]);
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < kBlock; ++i) reinterpret_cast<float*>(Xblk + lower_block(warp, warp))[i * kBlock + j] = x[i];
    }
  }
  // Levels: X_bj = -X_bb sum_{m = j}^{b - 1} L_bm X_mj for j = b - level, each level after the last.
  auto a_frag = [&](const float* blk, int kt, uint32_t (&a)[4]) {  // rows g, g + 8; k-slots t, t + 4 of k-tile kt
    a[0] = __float_as_uint(blk[g * kBlock + 8 * kt + t]), a[1] = __float_as_uint(blk[(g + 8) * kBlock + 8 * kt + t]);
    a[2] = __float_as_uint(blk[g * kBlock + 8 * kt + t + 4]), a[3] = __float_as_uint(blk[(g + 8) * kBlock + 8 * kt + t + 4]);
  };
  auto product = [&](const float* A, const float* B, float (&c)[2][4]) {  // c += A B, 16 x 16 x 16 in tf32
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      uint32_t a[4];
      a_frag(A, kt, a);
#pragma unroll
      for (int n = 0; n < 2; ++n)
        ptx::mma_tf32_1688(c[n], a, B[(8 * kt + t) * kBlock + 8 * n + g], B[(8 * kt + t + 4) * kBlock + 8 * n + g]);
    }
  };
  for (int level = 1; level < kBlocks; ++level) {
    warpgroup_barrier(kPrepBarrier);  // the previous level's blocks written
    const int j = warp - level;
    if (j >= 0) {
      float y[2][4] = {};
      for (int m = j; m < warp; ++m)
        product(reinterpret_cast<const float*>(Lblk + lower_block(warp, m)), reinterpret_cast<const float*>(Xblk + lower_block(m, j)), y);
      // y into X_bj's place (fp32 [16][16]) as the B operand of X_bb y; then the result over it.
      put_block(Xblk, y, warp, j, false, 1.f);
      __syncwarp();
      float x[2][4] = {};
      product(reinterpret_cast<const float*>(Xblk + lower_block(warp, warp)), reinterpret_cast<const float*>(Xblk + lower_block(warp, j)), x);
      __syncwarp();
      put_block(Xblk, x, warp, j, false, -1.f);
    }
  }
  warpgroup_barrier(kPrepBarrier);  // every X block

  // W = X Diag(beta) (fp16) into the stage, and Wk = W Kt (fp16 mma) from it, a block of rows a warp.
  {
    uint32_t wa[kBlocks][4];  // A fragments of W_bj (m16n8k16: k = columns of block j)
#pragma unroll
    for (int jb = 0; jb < kBlocks; ++jb) {
      const float* X = reinterpret_cast<const float*>(Xblk + lower_block(warp, jb));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r & 1), col = 8 * (r >> 1) + 2 * t;
        const float b0 = beta[kBlock * jb + col], b1 = beta[kBlock * jb + col + 1];
        const float x0 = jb <= warp ? X[row * kBlock + col] * b0 : 0.f, x1 = jb <= warp ? X[row * kBlock + col + 1] * b1 : 0.f;
        wa[jb][r] = ptx::pack_f16x2(x0, x1);
        at<uint32_t>(op, OpStage::kW + tile_offset(kBlock * warp + row, kBlock * jb + col, kC)) = wa[jb][r];
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // channels 64 half .. 64 half + 63
      float acc[8][4] = {};
#pragma unroll
      for (int jb = 0; jb < kBlocks; ++jb) {
        if (jb > warp) break;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int ch = 64 * half + 8 * n + g;  // B column g: channel; k = tokens 16 jb + 2t (+8)
          const uint32_t b0 = at<uint32_t>(op, OpStage::kKrT + tile_offset(ch, kBlock * jb + 2 * t, kC));
          const uint32_t b1 = at<uint32_t>(op, OpStage::kKrT + tile_offset(ch, kBlock * jb + 8 + 2 * t, kC));
          ptx::mma_f16_16816(acc[n], wa[jb], b0, b1);
        }
      }
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          at<uint32_t>(op, OpStage::kWk + tile_offset(i0 + 8 * h, 64 * half + 8 * n + 2 * t, kD)) =
              ptx::pack_f16x2(acc[n][2 * h], acc[n][2 * h + 1]);
    }
  }
  warpgroup_barrier(kPrepBarrier);  // Kt^T read by every warp

  // 6. Kr^T = (k^ e^(T_b - G)) e^(G_C - R_(b+1)) over Kt^T's place.
#pragma unroll
  for (int kk = 0; kk < 16; ++kk) {
    const int c = 8 * kk + 2 * t;
    const float2 e = *reinterpret_cast<const float2*>(eKr + warp * kD + c);
    const float e0 = e.x, e1 = e.y;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = h ? i1 : i0;
      const float2 kr = unpack_f16x2(at<uint32_t>(in, kInG + swizzled_offset(tok, c)));
      at<__half>(op, OpStage::kKrT + tile_offset(c, tok, kC)) = __float2half_rn(kr.x * e0);
      at<__half>(op, OpStage::kKrT + tile_offset(c + 1, tok, kC)) = __float2half_rn(kr.y * e1);
    }
  }
  ptx::fence_proxy_async_shared();  // the tiles, written by ordinary stores, read by wgmma
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
};

__device__ __forceinline__ void math_item(const FusedParams& p, const Item& it, const MathLane& L, uint8_t* smem_op,
                                          const OpRing& ring) {
  const int t = L.t, g = L.g;
  const int64_t state_head = (it.seq * p.num_heads + it.head) * int64_t{kD} * kD;
  // S^T rows row(0), row(1); columns 8 j + 2t, + 1 (j < 16): an m64n128 D accumulator. Element
  // offsets of a row's pairs: the row's own, then 8 j (immediates: 32 addresses kept through the
  // chunks would spill).
  auto state_row = [&](int h) { return state_head + int64_t{L.row(h)} * kD + 2 * t; };
  float s[64];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = state_row(h);
    const float* f32 = static_cast<const float*>(p.initial_state) + row;
    const uint16_t* b16 = static_cast<const uint16_t*>(p.initial_state) + row;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float2 x = make_float2(0.f, 0.f);
      if (p.initial_state) x = p.initial_f32 ? *reinterpret_cast<const float2*>(f32 + 8 * j)
                                             : ptx::unpack_bf16x2(*reinterpret_cast<const uint32_t*>(b16 + 8 * j));
      s[4 * j + 2 * h] = x.x, s[4 * j + 2 * h + 1] = x.y;
    }
  }
  int e_row[2] = {0, 0};  // S^ = S 2^-e_row
  // V^T's fragment elements in the warpgroup's box: token 16 ks + 8 (r >> 1) + 2t + e, value row
  // 16 warp + g + 8 (r & 1); swizzled_offset of it is this offset (rows 2t + e of a group of 8) plus
  // 128 (16 ks + 8 (r >> 1)), a constant. Formed once: ptxas would otherwise hoist 32 offsets.
  uint32_t v_offset[2][2];
#pragma unroll
  for (int r1 = 0; r1 < 2; ++r1)
#pragma unroll
    for (int e = 0; e < 2; ++e) v_offset[r1][e] = swizzled_offset(2 * t + e, 16 * L.warp + g + 8 * r1);
  const int chunks = it.chunks();
  OpRing::Cursor pos;
  for (int c = 0; c < chunks; ++c, pos.advance()) {
    uint8_t* op = smem_op + pos.stage * OpStage::kBytes;
    const int count = static_cast<int>(it.len - int64_t{kC} * c < kC ? it.len - int64_t{kC} * c : kC);
    ring.wait_full(pos);

    // V^T's fragments (rows v, k = tokens; bf16 pairs as loaded, zero past the chunk's tokens) from
    // this warpgroup's box, then each row's new scale, then the fragments in fp16 at that scale.
    uint8_t* vbox = op + OpStage::kV + L.wg * kBoxBytes;
    uint32_t vraw[4][4];
    float vmax[2] = {0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tok = 16 * ks + 8 * (r >> 1) + 2 * t;
        uint32_t pair = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // swizzled_offset(tok + e, value row): a per-thread offset + a constant
          const uint32_t raw = at<uint16_t>(vbox, v_offset[r & 1][e] + 128 * (16 * ks + 8 * (r >> 1)));
          pair |= (tok + e < count ? raw : 0u) << (16 * e);
        }
        vraw[ks][r] = pair;
        vmax[r & 1] = fmaxf(vmax[r & 1], fmaxf(fabsf(bf16_lo(pair)), fabsf(bf16_hi(pair))));
      }
    float scale_v[2];  // 2^-e_row after the rescale
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float smax = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) smax = fmaxf(smax, fmaxf(fabsf(s[4 * j + 2 * h]), fabsf(s[4 * j + 2 * h + 1])));
      float m = fmaxf(smax * pow2(e_row[h]), vmax[h]);  // true scale
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      // max in [4, 8) at 2^-e_new; a row of zeros, Inf or NaN keeps its scale (branch-free: a
      // conditional rescale of all of S^T would cost ptxas a second copy of it).
      const bool rescale = m > 0.f && m < __int_as_float(0x7f800000);
      const int e_new = rescale ? exponent_of(m) - 2 : e_row[h];
      const float f = pow2(e_row[h] - e_new);
#pragma unroll
      for (int j = 0; j < 16; ++j) s[4 * j + 2 * h] *= f, s[4 * j + 2 * h + 1] *= f;
      e_row[h] = e_new;
      scale_v[h] = pow2(-e_row[h]);
    }
    uint32_t va[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        va[ks][r] = ptx::pack_f16x2(bf16_lo(vraw[ks][r]) * scale_v[r & 1], bf16_hi(vraw[ks][r]) * scale_v[r & 1]);
    uint32_t sa[8][4];
    ptx::f16_a_from_d<8>(s, sa);

    const uint64_t d_wk = ptx::smem_matrix_desc(op + OpStage::kWk, 128, tile_stride_bytes(kD));
    const uint64_t d_qt = ptx::smem_matrix_desc(op + OpStage::kQt, 128, tile_stride_bytes(kD));
    const uint64_t d_kr = ptx::smem_matrix_desc(op + OpStage::kKrT, 128, tile_stride_bytes(kC));
    const uint64_t d_m = ptx::smem_matrix_desc(op + OpStage::kM, 128, tile_stride_bytes(kC));
    const uint64_t d_w = ptx::smem_matrix_desc(op + OpStage::kW, 128, tile_stride_bytes(kC));
    float u[32], pacc[32];
    ptx::fence_operands(s);
    ptx::fence_operands(sa);
    ptx::fence_operands(va);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<64>(u, va[ks], ptx::smem_matrix_desc_advance(d_w, 256 * ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(u, sa[ks], ptx::smem_matrix_desc_advance(d_wk, 256 * ks), true, true);
    ptx::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) ptx::wgmma_f16<64>(pacc, sa[ks], ptx::smem_matrix_desc_advance(d_qt, 256 * ks), ks > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();
    ptx::fence_operands(u);

    uint32_t ua[4][4];
    ptx::f16_a_from_d<4>(u, ua);
    const float* decay = reinterpret_cast<const float*>(op + OpStage::kDecay);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(decay + 8 * j + 2 * t);
      s[4 * j] *= d.x, s[4 * j + 1] *= d.y, s[4 * j + 2] *= d.x, s[4 * j + 3] *= d.y;
    }
    ptx::fence_operands(s);
    ptx::fence_operands(ua);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<128>(s, ua[ks], ptx::smem_matrix_desc_advance(d_kr, 256 * ks), true);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ptx::wgmma_f16<64>(pacc, ua[ks], ptx::smem_matrix_desc_advance(d_m, 256 * ks), true);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(s);
    ptx::fence_operands(pacc);

    // out rows: O^T = P^T 2^e_row into this warpgroup's V box (read above) by stmatrix.trans (the
    // warp's 16 value rows x 16 tokens a store: token rows of 8 + 8 values), then 16-byte stores.
    {
      const float up0 = pow2(e_row[0]), up1 = pow2(e_row[1]);
      const int lane = L.lane, m = lane / 8;
      const int vv = 16 * L.warp + 8 * (m & 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t r[4] = {ptx::pack_bf16x2(pacc[8 * q] * up0, pacc[8 * q + 1] * up0),
                               ptx::pack_bf16x2(pacc[8 * q + 2] * up1, pacc[8 * q + 3] * up1),
                               ptx::pack_bf16x2(pacc[8 * q + 4] * up0, pacc[8 * q + 5] * up0),
                               ptx::pack_bf16x2(pacc[8 * q + 6] * up1, pacc[8 * q + 7] * up1)};
        const int tok = 16 * q + 8 * (m >> 1) + lane % 8;
        ptx::stmatrix_x4_trans(ptx::smem_addr(vbox + swizzled_offset(tok, vv)), r);
      }
    }
    warpgroup_barrier(kMathBarrier + L.wg);
    const int tid = threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 16 * i + tid / 8, chunk = tid % 8;
      if (tok < count) {
        const int64_t row = it.bos + int64_t{kC} * c + tok;
        *reinterpret_cast<uint4*>(p.out + (row * p.num_heads + it.head) * kD + kMathRows * L.wg + 8 * chunk) =
            *reinterpret_cast<const uint4*>(vbox + tok * 128 + ((chunk ^ (tok % 8)) * 16));
      }
    }
    ptx::fence_proxy_async_shared();  // the out rows written over V, before the copy engine refills the box
    ring.release(pos);
  }
  if (p.final_state) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = state_row(h);
      float* f32 = static_cast<float*>(p.final_state) + row;
      uint16_t* b16 = static_cast<uint16_t*>(p.final_state) + row;
      const float f = pow2(e_row[h]);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float x0 = s[4 * j + 2 * h] * f, x1 = s[4 * j + 2 * h + 1] * f;
        if (p.final_f32) *reinterpret_cast<float2*>(f32 + 8 * j) = make_float2(x0, x1);
        else *reinterpret_cast<uint32_t*>(b16 + 8 * j) = ptx::pack_bf16x2(x0, x1);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, 1) fused_prefill_kernel(const __grid_constant__ FusedParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];  // the copy engine's swizzled boxes need 1024-byte alignment
  uint8_t* in = smem + kSmemIn;
  uint8_t* op_stages = smem + kSmemOp;
  uint8_t* small = smem + kSmemSmall;
  uint64_t* bars = reinterpret_cast<uint64_t*>(small + Small::kBarriers);
  uint64_t* in_full = bars;  // the input stage: its leader's expect_tx and the copies' bytes
  const OpRing ring{bars + 1, bars + 1 + kOpStages};

  Item it;
  it.head = static_cast<int>(blockIdx.x % p.num_heads);
  it.seq = blockIdx.x / p.num_heads;
  int64_t eos;
  p.seqs.bounds(it.seq, it.bos, eos);
  it.len = eos - it.bos;

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(in_full, 1);
    ring.init(kMathThreads, kPrepThreads);  // its fence publishes in_full too
  }
  __syncthreads();

  if (threadIdx.x < kPrepThreads) {
    set_max_registers_dec<kPrepRegs>();
    const PrepLane L{static_cast<int>(threadIdx.x / 32), static_cast<int>(threadIdx.x % 32),
                     static_cast<int>(threadIdx.x % 32) / 4, static_cast<int>(threadIdx.x % 4)};
    const int chunks = it.chunks();
    float* dtb = reinterpret_cast<float*>(small + Small::kDtBias);
    dtb[threadIdx.x] = p.dt_bias[it.head * kD + threadIdx.x];
    const float neg_expA_log2e = -ptx::kLog2e * expf(p.A_log[it.head]);
    const bool leader = threadIdx.x == 0;
    auto row_of = [&](int c) { return static_cast<int>(it.bos + int64_t{kC} * c); };
    if (leader && chunks > 0) {
      ptx::mbarrier_arrive_expect_tx(in_full, kInBytes);
      load_tile(in + kInQ, &p.q_tiles, it.head, row_of(0), in_full);
      load_tile(in + kInK, &p.k_tiles, it.head, row_of(0), in_full);
      load_tile(in + kInG, &p.g_tiles, it.head, row_of(0), in_full);
    }
    for (int c = 0; c < chunks; ++c) {
      const OpRing::Cursor pos = OpRing::Cursor::of_fill(c);
      uint8_t* op = op_stages + pos.stage * OpStage::kBytes;
      const int count = static_cast<int>(it.len - int64_t{kC} * c < kC ? it.len - int64_t{kC} * c : kC);
      if (leader && c + 1 < chunks) {  // the next chunk's rows toward the L2 while this one is worked on
        for (const CUtensorMap* m : {&p.q_tiles, &p.k_tiles, &p.g_tiles, &p.v_tiles}) {
          prefetch_tile_l2(m, 0, it.head, row_of(c + 1));
          prefetch_tile_l2(m, 64, it.head, row_of(c + 1));
        }
      }
      if (threadIdx.x < kC) {
        float b = 0.f;
        if (static_cast<int>(threadIdx.x) < count) {
          const int64_t row = it.bos + int64_t{kC} * c + threadIdx.x;
          const float x = __uint_as_float(uint32_t{*p.beta.row(row, it.head)} << 16);
          b = ptx::rcp_ftz(1.0f + ptx::exp2_ftz(-ptx::kLog2e * x));
        }
        reinterpret_cast<float*>(small + Small::kBeta)[threadIdx.x] = b;
      }
      // The stage's previous chunk (c - 2) released by the math warpgroups, then this chunk's V.
      ring.wait_empty(pos);
      if (leader) {  // V's bytes join the phase that the 128 prep arrivals complete
        ptx::mbarrier_expect_tx(ring.full_barrier(pos), kSwizzledTileBytes);
        load_tile(op + OpStage::kV, &p.v_tiles, it.head, row_of(c), ring.full_barrier(pos));
      }
      ptx::mbarrier_wait_parity(in_full, c & 1);
      warpgroup_barrier(kPrepBarrier);  // beta, dt_bias
      prep_chunk(p, L, in, op, smem + kSmemL, small, count, neg_expA_log2e);
      ptx::mbarrier_arrive(ring.full_barrier(pos));
      warpgroup_barrier(kPrepBarrier);  // the input stage free
      if (leader) {
        if (c + 1 < chunks) {
          ptx::mbarrier_arrive_expect_tx(in_full, kInBytes);
          load_tile(in + kInQ, &p.q_tiles, it.head, row_of(c + 1), in_full);
          load_tile(in + kInK, &p.k_tiles, it.head, row_of(c + 1), in_full);
          load_tile(in + kInG, &p.g_tiles, it.head, row_of(c + 1), in_full);
        }
      }
    }
  } else {
    set_max_registers_inc<kMathRegs>();
    const int tid = threadIdx.x - kPrepThreads;
    const MathLane L{tid / 128, (tid / 32) % 4, tid % 32, (tid % 32) / 4, tid % 4};
    math_item(p, it, L, op_stages, ring);
  }
}

}  // namespace

void launch_fused(const FusedParams& p, cudaStream_t stream) {
  const int64_t blocks = p.seqs.num_seqs * p.num_heads;
  if (blocks == 0) return;
  if (blocks > INT32_MAX) fail(ErrorCode::kUnsupported, "q: the fused prefill takes fewer than 2^31 (sequence, head) pairs");
  static PerDeviceOnce raised;  // the shared-memory limit, raised once per device the caller uses
  raised.run("raising the fused prefill kernel's shared-memory limit", [] {
    return cudaFuncSetAttribute(fused_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  });
  fused_prefill_kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "launching the fused prefill kernel failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
