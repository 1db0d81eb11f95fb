// Prep kernel: everything of a chunk that does not depend on the state, one block per
// (chunk slot, head), thread c owning key channel c (and value channel c).
#include <cuda_runtime.h>

#include <algorithm>

#include "common/fail.h"
#include "common/bf16.h"
#include "gpu/launch/programmatic_launch.h"
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/item_scheduler.cuh"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/fast_math.cuh"
#include "gpu/ptx/grid_sync.cuh"
#include "gpu/ptx/mma.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxGridY = 65535;  // slots go over grid.y, then grid.z

// Finds the chunk a slot holds: its sequence, first token and token count (0 for an unused slot).
// Called by the whole block: the sequence is the largest n with first_slot(n) <= slot. With
// cu_seqlens every test reads device memory, and a binary search made that log2(N) dependent
// loads at the start of every block (P9's 64 sequences: six; its prep kernel took ~14% longer a
// chunk than P1's with one sequence). Here a round tests kThreads candidates at once, a load
// each, and counts the hits (first_slot grows with n): one round up to 128 sequences.
__device__ __forceinline__ void locate_slot(const SequenceTable& seqs, int64_t slot, int64_t& seq, int64_t& t0,
                                            int& count) {
  int64_t lo = 0, hi = seqs.num_seqs - 1;
  if (seqs.cu_seqlens) {
    while (lo < hi) {  // uniform over the block
      const int64_t step = (hi - lo + kThreads) / kThreads;  // candidates lo, lo + step, ..., up to hi
      const int64_t n = lo + step * threadIdx.x;
      const int hits = __syncthreads_count(n <= hi && seqs.first_slot(n, seqs.offset(n)) <= slot);
      if (hits == 0) break;  // not even lo (cu_seqlens[0] > 0): sequence 0, as the binary search gives
      lo += step * (hits - 1);
      hi = min(hi, lo + step - 1);
    }
  } else {  // no loads: a binary search
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (seqs.first_slot(mid, seqs.offset(mid)) <= slot) lo = mid;
      else hi = mid - 1;
    }
  }
  int64_t bos, eos;
  seqs.bounds(lo, bos, eos);
  seq = lo;
  const int64_t chunk = slot - seqs.first_slot(lo, bos);
  t0 = bos + chunk * kChunk;
  count = (chunk < 0 || t0 >= eos) ? 0 : static_cast<int>(eos - t0 < kChunk ? eos - t0 : kChunk);
}

// Thread c's two entries (entry_row(c, r), entry_col(c)), r = 0, 1, of a 16 x 16 matrix: the
// 256 entries over 128 threads with row and column known without a division or a loop bound.
static_assert(kChunk * kChunk == 2 * kThreads, "two entries of a chunk matrix a thread");
__device__ __forceinline__ int entry_row(int c, int r) { return c / kChunk + r * (kThreads / kChunk); }
__device__ __forceinline__ int entry_col(int c) { return c % kChunk; }

constexpr int kTileStride = kHeadDim + 8;  // fp32 [16][136] tiles: row r starts in bank 8r, so the
                                           // 8-byte fragment reads of rows g = 0..3 never collide
constexpr int kSmallStride = kChunk + 4;   // fp32 [16][20] matrices (L, M, W): the A fragments of
                                           // W and M (row g, column t) fall in 32 distinct banks

// Shared memory. The loaded bf16 rows and the fp32 tiles live in one buffer, in turn (a
// __syncthreads separates the last read of one from the first write of the other). The rows are
// stored as token pairs, channel-major within a pair: thread c then reads its channel of two
// tokens in one 4-byte load, a warp 128 contiguous bytes (one shared-memory wavefront; the 2-byte
// reads of a [token][channel] image took one for 64 bytes: 48 reads a thread, 24 now).
struct PrepSmem {
  union {
    uint32_t in[3][kChunk / 2][kHeadDim];  // q, k, g as loaded, bf16 token pairs (2p low, 2p + 1 high)
    float tile[3][kChunk][kTileStride];  // K~, K-, Q~ (K~, K- rounded to tf32)
  };
  float part[4][kChunk][kChunk];          // L and M partial products, two channel halves each
  alignas(16) float rnorm[2 * kChunk];    // scale/||q_t||, then 1/||k_t|| (read as float4: 8 loads, not 32)
  float beta[kChunk];
  alignas(16) float L[kChunk][kSmallStride];
  alignas(16) float M[kChunk][kSmallStride];
  alignas(16) float W[kChunk][kSmallStride];
};

// Tokens 4 quad .. 4 quad + 3's scale / ||q_t|| or 1 / ||k_t|| (base 0 or kChunk) by one 16-byte load
// (32 scalar loads a thread were 8 16-byte ones; a float4 read per token the compiler narrows again).
__device__ __forceinline__ void rnorm_quad(const PrepSmem& sm, int base, int quad, float (&r)[4]) {
  const float4 v = reinterpret_cast<const float4*>(sm.rnorm + base)[quad];
  r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
}

// Which half of its segment (channels 0..3 or 4..7) thread c's i-th 16-byte store of phase 1
// writes: swapped where seg / 4 is odd, so that the 8 lanes of each quarter-warp write 8
// different 4-bank groups of an sm.in plane (word pair * 128 + seg * 8 + 4 * half): no conflict.
__host__ __device__ constexpr int pair_store_half(int seg, int i) { return ((seg >> 2) ^ i) & 1; }
constexpr bool pair_stores_conflict_free() {
  for (int i = 0; i < 2; ++i)
    for (int lane0 = 0; lane0 < kThreads; lane0 += 8) {
      unsigned groups = 0;
      for (int c = lane0; c < lane0 + 8; ++c) {
        const int word = (c >> 4) * kHeadDim + (c & 15) * 8 + 4 * pair_store_half(c & 15, i);
        groups |= 1u << (word / 4 % 8);
      }
      if (groups != 0xffu) return false;
    }
  return true;
}
static_assert(pair_stores_conflict_free(), "each quarter-warp's 16-byte stores cover the 32 banks once");

// Channel c of the 16 rows of input m (0: q, 1: k, 2: g) from sm.in, widened to fp32.
__device__ __forceinline__ void channel_rows(const PrepSmem& sm, int m, int c, float (&v)[kChunk]) {
#pragma unroll
  for (int pair = 0; pair < kChunk / 2; ++pair) {
    const float2 x = ptx::unpack_bf16x2(sm.in[m][pair][c]);
    v[2 * pair] = x.x;
    v[2 * pair + 1] = x.y;
  }
}

// A fragment of a 16-row fp32 matrix in shared memory for m16n8k8 tf32 (k-slot t = column
// 2t, slot t + 4 = column 2t + 1 of the 8-column k-tile starting at col0; see mma.cuh).
template <int kStride>
__device__ __forceinline__ void load_a(const float (*m)[kStride], int col0, int g, int t4, uint32_t (&a)[4]) {
  const float2 top = *reinterpret_cast<const float2*>(&m[g][col0 + 2 * t4]);
  const float2 bottom = *reinterpret_cast<const float2*>(&m[g + 8][col0 + 2 * t4]);
  a[0] = __float_as_uint(top.x);
  a[1] = __float_as_uint(bottom.x);
  a[2] = __float_as_uint(top.y);
  a[3] = __float_as_uint(bottom.y);
}

// The products A B^T of two [16][128] tiles (tf32), 16 x 16 per pair: warps 0, 1 take
// tile[0] tile[1]^T over channel halves (L's), warps 2, 3 take tile[2] tile[1]^T (M's); the
// halves land in sm.part and are added by the caller.
__device__ __forceinline__ void lm_products(PrepSmem& sm, int warp, int g, int t4) {
  const float(*a_tile)[kTileStride] = warp < 2 ? sm.tile[0] : sm.tile[2];
  float acc[2][4] = {};
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    const int col0 = (warp & 1) * 64 + kt * 8;
    uint32_t a[4];
    load_a<kTileStride>(a_tile, col0, g, t4, a);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 b = *reinterpret_cast<const float2*>(&sm.tile[1][nt * 8 + g][col0 + 2 * t4]);
      ptx::mma_tf32_1688(acc[nt], a, b.x, b.y);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    *reinterpret_cast<float2*>(&sm.part[warp][g][nt * 8 + 2 * t4]) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(&sm.part[warp][g + 8][nt * 8 + 2 * t4]) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// log(1 + z) for z in [0, 1]: 2 atanh(s), s = z / (2 + z) in [0, 1/3], the odd series to s^13
// (truncation under 2e-8 relative), exact also for tiny z, where softplus's small values decide a
// near-zero decay summed over thousands of tokens. A third of log1pf's instructions: measured on
// the H200 at P1 with the softplus gate, the prep kernel took 0.670 ms with it, 0.681 with
// log1pf (0.549 with the safe gate), the whole call 1.348 against 1.358 ms.
__device__ __forceinline__ float log1p_unit(float z) {
  const float s = z * ptx::rcp_ftz(2.0f + z), s2 = s * s;
  float r = 1.0f / 13.0f;
  r = fmaf(r, s2, 1.0f / 11.0f);
  r = fmaf(r, s2, 1.0f / 9.0f);
  r = fmaf(r, s2, 1.0f / 7.0f);
  r = fmaf(r, s2, 1.0f / 5.0f);
  r = fmaf(r, s2, 1.0f / 3.0f);
  r = fmaf(r, s2, 1.0f);
  return 2.0f * s * r;
}

// The softplus gate's log-decay in base 2, a log2(e) = -exp(A_log) softplus(x) log2(e) with
// softplus(x) = max(x, 0) + log1p(e^-|x|), clamped at -100 nats a token as the CPU backend does
// (exp(-100) is 0 in fp32 already; NaN stays NaN, +-inf give the clamp and 0).
__device__ __forceinline__ float softplus_log2_decay(float x, float neg_expA_log2e) {
  const float a2 = neg_expA_log2e * (fmaxf(x, 0.0f) + log1p_unit(ptx::exp2_ftz(-ptx::kLog2e * fabsf(x))));
  constexpr float kMin = -100.0f * ptx::kLog2e;
  return a2 < kMin ? kMin : a2;
}

template <RecordForm kForm>
__device__ __forceinline__ uint8_t* record_of(const PrepParams& p, int64_t slot, int h) {
  constexpr int64_t kBytes = record_bytes(kForm);
  return p.records + (slot * p.num_heads + h) * kBytes;
}

// Kr^T: channel c is row g = c % 8 of channel tile c / 8; its 16 tokens are the lanes
// (g, t = 0..3) of the two token-half fragments: two 16-byte stores per half. In a WgmmaRecord,
// channel c is row c of both token steps' tiles: the step's even tokens fill slots 0..3, its
// odd ones slots 4..7 (permuted), a 16-byte store each. In an F16Record, channel c's 16 tokens are
// 32 bytes of fp16 pairs (tokens 2 t4, + 1 then 2 t4 + 8, + 9 for t4 = 0..3): two 16-byte stores.
template <RecordForm kForm>
__device__ __forceinline__ void store_kr(uint8_t* rec, int c, const float (&kr)[kChunk]) {
  if constexpr (kForm == RecordForm::kF16) {
    uint32_t w[8];
#pragma unroll
    for (int t4 = 0; t4 < 4; ++t4) {
      w[2 * t4] = ptx::pack_f16x2(kr[2 * t4], kr[2 * t4 + 1]);
      w[2 * t4 + 1] = ptx::pack_f16x2(kr[2 * t4 + 8], kr[2 * t4 + 9]);
    }
    uint4* dst = reinterpret_cast<uint4*>(rec + F16Record::kr_channel(c));
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else if constexpr (kForm == RecordForm::kWgmma) {
#pragma unroll
    for (int ts = 0; ts < 2; ++ts) {
      uint8_t* dst = rec + WgmmaRecord::kr_row(ts, c);  // slots 0..3: tokens 8 ts + 0, 2, 4, 6; 4..7: the odd ones
#pragma unroll
      for (int odd = 0; odd < 2; ++odd)
        *reinterpret_cast<float4*>(dst + 128 * odd) =
            make_float4(ptx::tf32_operand(kr[8 * ts + odd]), ptx::tf32_operand(kr[8 * ts + odd + 2]),
                        ptx::tf32_operand(kr[8 * ts + odd + 4]), ptx::tf32_operand(kr[8 * ts + odd + 6]));
    }
  } else {
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      uint8_t* dst = rec + ChunkRecord::kKr + fragment_entry(2 * (c / 8) + kt, 4 * (c % 8), 8);
#pragma unroll
      for (int h = 0; h < 2; ++h)
        reinterpret_cast<float4*>(dst)[h] =
            make_float4(ptx::tf32_operand(kr[8 * kt + 4 * h + 0]), ptx::tf32_operand(kr[8 * kt + 4 * h + 1]),
                        ptx::tf32_operand(kr[8 * kt + 4 * h + 2]), ptx::tf32_operand(kr[8 * kt + 4 * h + 3]));
    }
  }
}

// W = (I + L)^{-1} Diag(beta): thread j < 16 solves column j by forward substitution.
__device__ __forceinline__ void solve_w(const float (&L)[kChunk][kSmallStride], const float (&beta)[kChunk],
                                        float (&W)[kChunk][kSmallStride], int c) {
  if (c < kChunk) {
    const int j = c;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float s = (i == j) ? 1.0f : 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m) s = fmaf(-L[i][m], x[m], s);
      x[i] = (i < j) ? 0.0f : s;
    }
    const float bj = beta[j];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) W[i][j] = x[i] * bj;
  }
}

// W, M and exp(G_C) of channel c (thread c) into the record.
template <RecordForm kForm>
__device__ __forceinline__ void store_w_m_decay(uint8_t* rec, const float (&W)[kChunk][kSmallStride],
                                                const float (&M)[kChunk][kSmallStride], int c, float e_C) {
  float* small = reinterpret_cast<float*>(rec);
  if constexpr (kForm == RecordForm::kWgmma) {
    // W split hi + lo here (rows t, columns t' in order: W V's A operand is loaded, not a D
    // fragment), M (tf32; t' permuted: its A operand is W V's D fragment) and exp(G_C).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = entry_row(c, r), j = entry_col(c);
      const float w = W[i][j], hi = ptx::tf32_high_part(w);
      small[WgmmaRecord::w(0, i, j) / 4] = hi;
      small[WgmmaRecord::w(1, i, j) / 4] = w - hi;
      small[WgmmaRecord::m(i, j) / 4] = ptx::tf32_operand(M[i][j]);
    }
    small[WgmmaRecord::kDecay / 4 + c] = e_C;
  } else {
    // W (fp32: the state kernel splits it hi + lo to form W V), M (tf32) and exp(G_C), alike in
    // ChunkRecord and F16Record.
    using Record = typename RecordOf<kForm>::type;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = entry_row(c, r), j = entry_col(c);
      small[Record::kM / 4 + swizzle_16(i, j)] = ptx::tf32_operand(M[i][j]);
      small[Record::kW / 4 + swizzle_16(i, j)] = W[i][j];
    }
    small[Record::kDecay / 4 + c] = e_C;
  }
}

// The A fragments of W and -M (tf32) for the products Wk = W K~ and Qe = Q~ - M Wk, k-slot t
// being token t and slot t + 4 token t + 4: a[r] is row g + 8 (r & 1), column 8 kt + t4 + 4 (r >> 1).
__device__ __forceinline__ void w_m_fragments(const float (&W)[kChunk][kSmallStride], const float (&M)[kChunk][kSmallStride],
                                              int g, int t4, uint32_t (&aw)[2][4], uint32_t (&am)[2][4]) {
#pragma unroll
  for (int kt = 0; kt < 2; ++kt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r & 1), col = kt * 8 + t4 + 4 * (r >> 1);
      aw[kt][r] = __float_as_uint(ptx::tf32_operand(W[row][col]));
      am[kt][r] = __float_as_uint(-ptx::tf32_operand(M[row][col]));  // Qe accumulates -M Wk
    }
}

// A lane's Wk pair (tf32) of n-tile `ntile`, token half r into the record: token g + 8 r, channels
// 8 ntile + 2 t4 (+1); in a WgmmaRecord k-step ntile, elements 2 t4 (+1). (F16Record: prep_chunk
// stores the pairs of two n-tiles together, store_f16_pairs.)
template <RecordForm kForm>
__device__ __forceinline__ void store_wk_pair(uint8_t* rec, int ntile, int r, int lane, float2 x) {
  if constexpr (kForm == RecordForm::kWgmma) {
    uint8_t* const at = rec + WgmmaRecord::wk_pair(ntile, r, lane);
    *reinterpret_cast<float*>(at) = x.x;
    *reinterpret_cast<float*>(at + WgmmaRecord::kOddSlot) = x.y;
  } else {
    *reinterpret_cast<float2*>(rec + ChunkRecord::kWk + fragment_entry(16 * r + ntile, lane, 8)) = x;
  }
}

// The same lane's Qe pair: bf16 in 8x1 records, fp32 (tf32-rounded) in a WgmmaRecord, whose pass
// reads Qe as a tf32 operand.
template <RecordForm kForm>
__device__ __forceinline__ void store_qe_pair(uint8_t* rec, int ntile, int r, int lane, float q0, float q1) {
  if constexpr (kForm == RecordForm::kWgmma) {
    uint8_t* const at = rec + WgmmaRecord::qe_pair(ntile, r, lane);
    *reinterpret_cast<float*>(at) = ptx::tf32_operand(q0);
    *reinterpret_cast<float*>(at + WgmmaRecord::kOddSlot) = ptx::tf32_operand(q1);
  } else {
    *reinterpret_cast<uint32_t*>(rec + ChunkRecord::kQe + fragment_entry(16 * r + ntile, lane, 4)) = ptx::pack_bf16x2(q0, q1);
  }
}

// F16Record: a lane's fp16 pairs of n-tiles 2 j (lo, packed already: held across the n-tile loop
// in one register, not two) and 2 j + 1 (hi), token half r, as one 8-byte entry of field kWk or
// kQe (whole 256-byte lines a warp, as the other forms).
__device__ __forceinline__ void store_f16_pairs(uint8_t* rec, uint32_t field, int j, int r, int lane, uint32_t lo, float2 hi) {
  *reinterpret_cast<uint2*>(rec + F16Record::pair(field, 2 * j, r, lane)) = make_uint2(lo, ptx::pack_f16x2(hi.x, hi.y));
}

// The record of one chunk (slot) of head h: `count` tokens (1..16) from token t0 of sequence
// `seq`, in the layout of kForm (record_form.h). Ends with the block's last reads of `sm` done by this thread only: a caller
// that goes on to another chunk puts a barrier first.
template <bool kSoftplus, RecordForm kForm>
__device__ __forceinline__ void prep_chunk(const PrepParams& p, PrepSmem& sm, int64_t slot, int h, int64_t seq,
                                           int64_t t0, int count) {
  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;

  // Phase 1: the chunk's q, k, g rows into shared memory with 16-byte loads (rows past the
  // sequence end are zero), beta's sigmoid (0 for padding: those tokens then change nothing).
  // The rows are read through their strides; a chunk never leaves its batch row (the sequence's
  // own row in the [B, T] form, the one row of a packed batch).
  {
    // Thread c loads 16-byte segment c % 16 of rows 2 (c / 16) and 2 (c / 16) + 1 of q, k and g
    // (token pair c / 16). The addresses are 64-bit products of the strides: formed once, and
    // once for all three views when their strides agree (dense inputs), not per load.
    const int64_t batch_row = p.seqs.cu_seqlens ? 0 : seq;
    const int pair = c >> 4, row0 = 2 * pair, seg = c & 15;
    const ActivationView* views[3] = {&p.q, &p.k, &p.g};
    const uint16_t* src[3];  // segment `seg` of row row0
    int64_t step[3];         // elements to row row0 + 1
    if (p.same_row_strides) {
      const int64_t off = p.q.offset_in_batch(batch_row, t0, h) + row0 * p.q.token + seg * 8;
#pragma unroll
      for (int m = 0; m < 3; ++m) src[m] = views[m]->data + off, step[m] = p.q.token;
    } else {
#pragma unroll
      for (int m = 0; m < 3; ++m)
        src[m] = views[m]->row_in_batch(batch_row, t0, h) + row0 * views[m]->token + seg * 8, step[m] = views[m]->token;
    }
    uint4 x[3][2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int m = 0; m < 3; ++m)
        x[m][r] = row0 + r < count ? __ldg(reinterpret_cast<const uint4*>(src[m] + r * step[m])) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      // Channel j of the two rows as one word (row0 low, row0 + 1 high): channels 0..3 of the
      // segment in one 16-byte store, 4..7 in the other, in the order pair_store_half gives.
      const uint32_t a[4] = {x[m][0].x, x[m][0].y, x[m][0].z, x[m][0].w};
      const uint32_t b[4] = {x[m][1].x, x[m][1].y, x[m][1].z, x[m][1].w};
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[2 * i] = __byte_perm(a[i], b[i], 0x5410), w[2 * i + 1] = __byte_perm(a[i], b[i], 0x7632);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int half = pair_store_half(seg, i);
        *reinterpret_cast<uint4*>(&sm.in[m][pair][seg * 8 + 4 * half]) =
            half ? make_uint4(w[4], w[5], w[6], w[7]) : make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    // L2 norms of the q and k rows: thread c holds 8 channels of rows row0 and row0 + 1, and
    // the 16 threads of a row pair (16 consecutive lanes) add up their squares.
    float ss[2][2];  // [q, k][row row0 + r]
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t w[4] = {x[m][r].x, x[m][r].y, x[m][r].z, x[m][r].w};
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 v = ptx::unpack_bf16x2(w[i]);
          sum = fmaf(v.x, v.x, fmaf(v.y, v.y, sum));
        }
#pragma unroll
        for (int lanes = 8; lanes >= 1; lanes >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
        ss[m][r] = sum;
      }
    if ((c & 15) == 0)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r;
        sm.rnorm[row] = p.scale * rsqrtf(ss[0][r] + 1e-6f);
        sm.rnorm[kChunk + row] = rsqrtf(ss[1][r] + 1e-6f);
      }
    if (c < kChunk) {
      const uint16_t* beta = p.beta.row_in_batch(batch_row, t0, h) + c * p.beta.token;
      const float b = c < count ? bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(beta))) : 0.0f;
      sm.beta[c] = c < count ? ptx::rcp_ftz(1.0f + ptx::exp2_ftz(-ptx::kLog2e * b)) : 0.0f;
    }
  }
  __syncthreads();

  // Phase 2: thread c takes key channel c (and value channel c) of the 16 tokens. The log-decay
  // is kept in base 2 (G2 = G log2(e)), so each exponential below is one exp2 instruction.
  const int g = lane >> 2, t4 = lane & 3;
  float q[kChunk], k[kChunk];
  float kr[kChunk];
  float e_C;  // decay of the whole chunk, exp(G_C)
  if constexpr (!kSoftplus) {
    float G2[kChunk];
    {
      const float neg_expA_log2e = -ptx::kLog2e * __expf(__ldg(p.A_log + h));
      const float bias = __ldg(p.dt_bias + h * kHeadDim + c);
      const float lb_log2e = ptx::kLog2e * p.lower_bound;
      float run = 0.0f, gx[kChunk];
      channel_rows(sm, 0, c, q);
      channel_rows(sm, 1, c, k);
      channel_rows(sm, 2, c, gx);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        // safe gate a = lower_bound * sigmoid(x), x = exp(A_log) (g + dt_bias); padding rows: a = 0.
        // Not one FFMA exp(A_log) g + exp(A_log) dt_bias: with A_log = +inf and g, dt_bias of
        // opposite signs that is inf - inf = NaN where the oracle's x is +-inf (measured: the
        // non-finite inputs test failed on it).
        const float e_negx = ptx::exp2_ftz(neg_expA_log2e * (gx[t] + bias));  // e^-x
        const float a2 = t < count ? lb_log2e * ptx::rcp_ftz(1.0f + e_negx) : 0.0f;
        G2[t] = (run += a2);  // cumulative log-decay G_t, base 2
      }
    }
    __syncthreads();  // every thread is done reading sm.in: its space becomes the fp32 tiles

    // Decayed rows: k~ = k^ e^G, k- = k^ e^-G (|G| <= 80 for the safe gate), q~ = scale q^ e^G,
    // kr = k^ e^(G_C - G). k and q become k~ and q~ in place.
    e_C = ptx::exp2_ftz(G2[kChunk - 1]);
#pragma unroll
    for (int quad = 0; quad < kChunk / 4; ++quad) {
      float rq[4], rk[4];
      rnorm_quad(sm, 0, quad, rq);
      rnorm_quad(sm, kChunk, quad, rk);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = 4 * quad + i;
        const float kh = k[t] * rk[i];
        const float e = ptx::exp2_ftz(G2[t]), e_inv = ptx::exp2_ftz(-G2[t]);
        const float k_minus = kh * e_inv;
        kr[t] = k_minus * e_C;  // k^ e^-G e^G_C: K-'s product reused (|k-| <= 2^116, finite)
        k[t] = kh * e;
        q[t] = q[t] * rq[i] * e;  // rnorm holds scale / ||q||
        sm.tile[0][t][c] = ptx::tf32_operand(k[t]);
        sm.tile[1][t][c] = ptx::tf32_operand(k_minus);
        sm.tile[2][t][c] = q[t];  // full fp32: Q~ is the starting value of Qe = Q~ - M Wk
      }
    }
    // F16Record: Kr stored now, as the softplus form does (kr's registers free for the rest; at
    // the end, the fp16 prep tail spilled 4 bytes under its 80-register bound).
    if constexpr (kForm == RecordForm::kF16) store_kr<kForm>(record_of<kForm>(p, slot, h), c, kr);
    __syncthreads();

    // L = K~ K-^T and M = Q~ K-^T on the tensor cores (tf32), the channel halves added here.
    lm_products(sm, warp, g, t4);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = entry_row(c, r), j = entry_col(c);
      sm.L[i][j] = i > j ? sm.beta[i] * (sm.part[0][i][j] + sm.part[1][i][j]) : 0.0f;  // strictly lower
      sm.M[i][j] = i >= j ? sm.part[2][i][j] + sm.part[3][i][j] : 0.0f;                // lower incl. diagonal
    }
  } else {
    // The softplus gate is unbounded: a chunk's decay spans far more than fp32's e^+-88, so no
    // single reference token keeps both factors of k_i e^(G_i - r) . k_j e^(r - G_j) finite. L and
    // M are formed in two passes of factored products whose factors stay in range
    // (tools/numerics/softplus_chunk_forms.py measures this form against fp64 pairwise values):
    //   1. the diagonal 8 x 8 blocks (i, j in one token half), the reference at the half's token 3,
    //      with each token's log-decay clamped at -20 nats for these factors only (a factor that
    //      crosses a clamped token is under e^-20 either way, below fp32's resolution of the sum);
    //   2. the cross block (i in 8..15, j in 0..7) with the reference at token 7: both factors
    //      e^(G_i - G_7) and e^(G_7 - G_j) are <= 1, exact.
    // Every factor below is a product of per-token decays d_t = e^(a_t) over the tokens between
    // its two ends, never a quotient of two running totals (those lose small decays next to a
    // large one), and the products cost no exponentials: four MUFU operations an element in all
    // (the gate's exp and reciprocal, d_t, one reciprocal for the clamped factors).
    float d[kChunk];  // e^(a_t); 1 for padding rows
    {
      const float neg_expA_log2e = -ptx::kLog2e * __expf(__ldg(p.A_log + h));
      const float bias = __ldg(p.dt_bias + h * kHeadDim + c);
      float gx[kChunk];
      channel_rows(sm, 0, c, q);
      channel_rows(sm, 1, c, k);
      channel_rows(sm, 2, c, gx);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        const float a2 = softplus_log2_decay(gx[t] + bias, neg_expA_log2e);
        d[t] = t < count ? ptx::exp2_ftz(a2) : 1.0f;
      }
    }
    __syncthreads();  // every thread is done reading sm.in: its space becomes the fp32 tiles

    // k and q become k^ and scale q^ (rnorm holds scale / ||q||); kr = k^ e^(G_C - G_t) from the
    // suffix products, stored now (16 registers fewer through the passes below).
#pragma unroll
    for (int quad = 0; quad < kChunk / 4; ++quad) {
      float rq[4], rk[4];
      rnorm_quad(sm, 0, quad, rq);
      rnorm_quad(sm, kChunk, quad, rk);
#pragma unroll
      for (int i = 0; i < 4; ++i) k[4 * quad + i] *= rk[i], q[4 * quad + i] *= rq[i];
    }
    float suffix = 1.0f;
#pragma unroll
    for (int t = kChunk - 1; t >= 0; --t) {
      kr[t] = k[t] * suffix;
      suffix *= d[t];
    }
    store_kr<kForm>(record_of<kForm>(p, slot, h), c, kr);
    e_C = suffix;  // the product of all 16

    // Pass 1: the diagonal blocks, e^(E_t) with E_t = Gc_t - Gc_r, r = token 3 of the half, Gc
    // the running log-decay with every token's clamped at -20 nats (dc_t = max(d_t, e^-20)):
    // |E_t| <= 80 nats, both factors finite.
    constexpr float kClampedDecay = 2.0611536e-9f;  // e^-20
    auto put = [&](int t, float e, float e_inv) {
      sm.tile[0][t][c] = ptx::tf32_operand(k[t] * e);
      sm.tile[1][t][c] = ptx::tf32_operand(k[t] * e_inv);
      sm.tile[2][t][c] = q[t] * e;
    };
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 8 * half + 3;
      float e = 1.0f, e_inv = 1.0f;  // e^(E_t), e^(-E_t)
      put(r, e, e_inv);
#pragma unroll
      for (int t = r - 1; t >= 8 * half; --t) {  // E_t = E_(t+1) - ac_(t+1)
        const float dc = fmaxf(d[t + 1], kClampedDecay);
        e *= ptx::rcp_ftz(dc);
        e_inv *= dc;
        put(t, e, e_inv);
      }
      e = e_inv = 1.0f;
#pragma unroll
      for (int t = r + 1; t < 8 * half + 8; ++t) {  // E_t = E_(t-1) + ac_t
        const float dc = fmaxf(d[t], kClampedDecay);
        e *= dc;
        e_inv *= ptx::rcp_ftz(dc);
        put(t, e, e_inv);
      }
    }
    __syncthreads();
    lm_products(sm, warp, g, t4);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = entry_row(c, r), j = entry_col(c);
      const bool diagonal_block = (i < 8) == (j < 8);  // the cross block comes in pass 2
      sm.L[i][j] = diagonal_block && i > j ? sm.beta[i] * (sm.part[0][i][j] + sm.part[1][i][j]) : 0.0f;
      sm.M[i][j] = diagonal_block && i >= j ? sm.part[2][i][j] + sm.part[3][i][j] : 0.0f;
    }
    // Pass 2: the cross block; rows 8..15 of the A tiles take e^(G_i - G_7), rows 0..7 of the B
    // tile e^(G_7 - G_j) (the other rows only feed entries this pass does not keep).
    {
      float down = 1.0f;  // e^(G_i - G_7)
#pragma unroll
      for (int i = 8; i < kChunk; ++i) {
        down *= d[i];
        sm.tile[0][i][c] = ptx::tf32_operand(k[i] * down);
        sm.tile[2][i][c] = q[i] * down;
      }
      float up = 1.0f;  // e^(G_7 - G_j)
#pragma unroll
      for (int j = 7; j >= 0; --j) {
        sm.tile[1][j][c] = ptx::tf32_operand(k[j] * up);
        up *= d[j];
      }
    }
    __syncthreads();
    lm_products(sm, warp, g, t4);
    __syncthreads();
    if (c < kChunk * kChunk / 4) {  // the 64 entries of the cross block, one a thread
      const int i = 8 + c / 8, j = c % 8;
      sm.L[i][j] = sm.beta[i] * (sm.part[0][i][j] + sm.part[1][i][j]);
      sm.M[i][j] = sm.part[2][i][j] + sm.part[3][i][j];
    }
    // The tiles the products with W and M read: K~ = k^ e^G (tf32) and Q~ = scale q^ e^G (fp32).
    float run = 1.0f;  // e^(G_t)
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      run *= d[t];
      sm.tile[0][t][c] = ptx::tf32_operand(k[t] * run);
      sm.tile[2][t][c] = q[t] * run;
    }
  }
  __syncthreads();

  solve_w(sm.L, sm.beta, sm.W, c);
  __syncthreads();


  // The record goes straight to global memory; every store below fills whole 32-byte sectors.
  uint8_t* rec = record_of<kForm>(p, slot, h);

  // Products with W and M on the tensor cores, warp w taking channels [32 w, 32 w + 32):
  //   Wk = W K~ and Qe = Q~ - M Wk.
  {
    // Here k-slot t is token t and slot t + 4 token t + 4 (mma.cuh's plain order): the B reads
    // below then take token rows t and t + 4 of the [16][136] tile, 8 banks apart for t = 0..3;
    // the permuted order (rows 2t, 2t + 1) put rows 0 and 4 in one bank, a 2-way conflict on
    // every B read (~6M of the prep kernel's 86M shared-memory wavefronts at P1, ncu).
    uint32_t aw[2][4], am[2][4];
    w_m_fragments(sm.W, sm.M, g, t4, aw, am);
    uint32_t wk_even[2], qe_even[2];  // F16Record: n-tile 2j's pairs (fp16), stored with 2j + 1's
#pragma unroll
    for (int nl = 0; nl < 4; ++nl) {
      const int ntile = warp * 4 + nl, ch = ntile * 8;  // this n-tile and its first channel
      float wk[4] = {}, qe[4];
      const float2 q0 = *reinterpret_cast<const float2*>(&sm.tile[2][g][ch + 2 * t4]);
      const float2 q1 = *reinterpret_cast<const float2*>(&sm.tile[2][g + 8][ch + 2 * t4]);
      qe[0] = q0.x, qe[1] = q0.y, qe[2] = q1.x, qe[3] = q1.y;
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const int j = kt * 8 + t4;  // B rows (tokens) j and j + 4, column ch + g
        ptx::mma_tf32_1688(wk, aw[kt], sm.tile[0][j][ch + g], sm.tile[0][j + 4][ch + g]);
      }
      __syncwarp();  // every lane has read K~ of these channels: the tile slot now takes Wk
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // C fragment rows g + 8r = token half r of fragment 16 r + ntile
        const float2 x = make_float2(ptx::tf32_operand(wk[2 * r]), ptx::tf32_operand(wk[2 * r + 1]));
        if constexpr (kForm != RecordForm::kF16) store_wk_pair<kForm>(rec, ntile, r, lane, x);
        else if (nl % 2 == 0) wk_even[r] = ptx::pack_f16x2(x.x, x.y);
        else store_f16_pairs(rec, F16Record::kWk, ntile / 2, r, lane, wk_even[r], x);
        *reinterpret_cast<float2*>(&sm.tile[0][g + 8 * r][ch + 2 * t4]) = x;
      }
      __syncwarp();  // C and B fragments are transposed: Wk comes back through shared memory
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        const int j = kt * 8 + t4;
        ptx::mma_tf32_1688(qe, am[kt], sm.tile[0][j][ch + g], sm.tile[0][j + 4][ch + g]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 x = make_float2(qe[2 * r], qe[2 * r + 1]);
        if constexpr (kForm != RecordForm::kF16) store_qe_pair<kForm>(rec, ntile, r, lane, x.x, x.y);
        else if (nl % 2 == 0) qe_even[r] = ptx::pack_f16x2(x.x, x.y);
        else store_f16_pairs(rec, F16Record::kQe, ntile / 2, r, lane, qe_even[r], x);
      }
    }
  }

  if constexpr (!kSoftplus && kForm != RecordForm::kF16) store_kr<kForm>(rec, c, kr);
  store_w_m_decay<kForm>(rec, sm.W, sm.M, c, e_C);
}

// A block per (chunk slot, head), heads fastest.
template <bool kSoftplus, RecordForm kForm>
__global__ void __launch_bounds__(kThreads) prep_kernel(const PrepParams p) {
  // The state grid launched after this one programmatically (StateParams::after_prep) may start
  // once every block has started: its blocks then take the multiprocessors the last ones leave.
  ptx::griddep_launch_dependents();
  const int h = blockIdx.x;
  int64_t slot = blockIdx.y + kMaxGridY * blockIdx.z;  // past the last slot: count 0 below
  if (const TailChunks& tail = p.tail.chunks; tail.per_segment > 0) {  // the tail's chunks are skipped
    if (slot >= tail.chunks - tail.count()) return;  // past the last (grid.z > 1)
    slot = tail.head_chunk(static_cast<int>(slot));
  }
  // The persistent state pass that follows in the stream counts its items from zero.
  if (p.item_counter && slot == 0 && h == 0 && threadIdx.x == 0) ItemScheduler{p.item_counter}.reset();
  if (p.seq_order && slot == 0 && h == 0) p.seqs.order_by_length(p.seq_order);
  int64_t seq, t0;
  int count;
  locate_slot(p.seqs, slot, seq, t0, count);
  if (count == 0) return;  // uniform over the block
  __shared__ __align__(128) PrepSmem sm;
  prep_chunk<kSoftplus, kForm>(p, sm, slot, h, seq, t0, count);
}

// The prep tail (PrepTail in kernels.h): the records of its TailChunks by a grid of six blocks a
// multiprocessor, launched before the state grid, whose blocks stay on the first `sms`
// multiprocessors to take any (`blocks_per_sm` each) and leave the others at once, so that the
// state grid finds them empty. A staying block takes (chunk, head) items from a counter in the
// order the chains need them (TailChunks::tail_chunk, heads fastest) and publishes each record by
// its ready flag; it never waits on the state pass. kForm: the records' layout (WgmmaRecords for
// the wgmma split pass).
template <bool kSoftplus, RecordForm kForm>
__global__ void __launch_bounds__(kThreads, kSoftplus ? 5 : 6) prep_tail_kernel(const PrepParams p) {
  ptx::griddep_launch_dependents();  // the state grid after this one may start: every block is resident
  __shared__ __align__(128) PrepSmem sm;
  __shared__ int64_t next[2];  // the block's next item, by the parity of its turn
  const PrepTail& t = p.tail;
  const ItemScheduler items_taken{t.item_counter};  // counter-only: every item from it (blocks may leave)
  const int tid = threadIdx.x;
  if (tid == 0) {
    const uint32_t id = ptx::sm_id();
    bool stays = false;
    if (id < kMaxSmIds) {
      const unsigned place = atomicAdd(t.sm_blocks + id, 1u);  // this block's place on its multiprocessor
      unsigned rank;                                            // the multiprocessor's, among those with blocks
      if (place == 0) {
        rank = atomicAdd(t.sm_count, 1u);
        ptx::store_release_gpu(t.sm_rank + id, rank + 1);
      } else {  // the first block here is resident: it stores the rank at once
        while ((rank = ptx::load_acquire_gpu(t.sm_rank + id)) == 0) ptx::nanosleep(32);
        rank -= 1;
      }
      stays = rank < static_cast<unsigned>(t.sms) && place < static_cast<unsigned>(t.blocks_per_sm);
    }
    next[0] = stays ? items_taken.take() : INT64_MAX;
  }
  __syncthreads();
  const int H = p.num_heads;
  const int64_t items = int64_t{t.chunks.count()} * H;
  int64_t item = next[0];
  for (int turn = 1; item < items; ++turn) {
    // Taken now, used after the chunk: the counter's latency hides behind the work.
    const int64_t after = tid == 0 ? items_taken.take() : 0;
    bool wrote;
    {
      const int h = static_cast<int>(item % H);
      const int64_t slot = t.chunks.tail_chunk(static_cast<int>(item / H));
      int64_t seq, t0;
      int count;
      locate_slot(p.seqs, slot, seq, t0, count);
      wrote = count > 0;
      if (wrote) {
        prep_chunk<kSoftplus, kForm>(p, sm, slot, h, seq, t0, count);
        ptx::fence_proxy_async_global();  // the state pass reads the record by bulk copies
      }
    }
    __syncthreads();  // every thread's record stores (and its reads of sm) are done
    if (tid == 0) {
      if (wrote) {
        // The item again from shared memory (next[] holds it for the whole turn), so that its
        // slot and head take no registers across the chunk (ptxas: the softplus forms' spills
        // 32 and 20 bytes with them kept, 24 and 0 now).
        const int64_t current = next[(turn - 1) & 1];
        const int64_t record = t.chunks.tail_chunk(static_cast<int>(current / H)) * H + current % H;
        __threadfence();
        ptx::store_release_gpu(t.ready + record, 1u);
        atomicAdd(t.done, 1u);  // after the fence above: a reader that acquires the count sees the record
      }
      next[turn & 1] = after;
    }
    __syncthreads();
    item = next[turn & 1];
  }
}

using PrepKernel = void (*)(const PrepParams);

// The instantiation for p's gate and record form: (safe, softplus) pairs of kTf32, kWgmma, kF16.
template <typename Kernel>
Kernel form_kernel(const PrepParams& p, Kernel tf32_safe, Kernel tf32_softplus, Kernel wgmma_safe, Kernel wgmma_softplus,
                   Kernel f16_safe, Kernel f16_softplus) {
  switch (p.record_form) {
    case RecordForm::kWgmma: return p.softplus_gate ? wgmma_softplus : wgmma_safe;
    case RecordForm::kF16: return p.softplus_gate ? f16_softplus : f16_safe;
    default: return p.softplus_gate ? tf32_softplus : tf32_safe;
  }
}

}  // namespace

void launch_prep(const PrepParams& p, int64_t num_slots, cudaStream_t stream) {
  // Heads fastest, then slots: blocks running at once read neighbouring rows of q, k, g ([T, H,
  // 128]) and the state pass's first chunks are written first. On the H200 (bench/results,
  // 2f353a9 against cf8bf4a, slots fastest against heads fastest): P1 1.245 -> 1.218 ms,
  // P4 0.798 -> 0.787, P10 1.613 -> 1.608 (repeat 1.621 -> 1.585).
  const dim3 grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(std::min(num_slots, kMaxGridY)),
                  static_cast<unsigned>((num_slots + kMaxGridY - 1) / kMaxGridY));
  const auto kernel = form_kernel<PrepKernel>(p, prep_kernel<false, RecordForm::kTf32>, prep_kernel<true, RecordForm::kTf32>,
                                              prep_kernel<false, RecordForm::kWgmma>, prep_kernel<true, RecordForm::kWgmma>,
                                              prep_kernel<false, RecordForm::kF16>, prep_kernel<true, RecordForm::kF16>);
  size_t pad = 0;
  if (p.blocks_per_sm > 0) {  // blocks_per_sm + 1 blocks must not fit a multiprocessor's shared memory
    int device = 0, per_sm = 0, reserved = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
    const size_t block = sizeof(PrepSmem) + static_cast<size_t>(reserved);
    const size_t share = static_cast<size_t>(per_sm) / static_cast<size_t>(p.blocks_per_sm);
    pad = share > block + 16 ? share - block - 16 : 0;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(pad));
  }
  launch_kernel(kernel, grid, dim3(kThreads), pad, stream, false, "prep kernel", p);
}

void launch_prep_tail(const PrepParams& p, int blocks, cudaStream_t stream) {
  const auto kernel =
      form_kernel<PrepKernel>(p, prep_tail_kernel<false, RecordForm::kTf32>, prep_tail_kernel<true, RecordForm::kTf32>,
                              prep_tail_kernel<false, RecordForm::kWgmma>, prep_tail_kernel<true, RecordForm::kWgmma>,
                              prep_tail_kernel<false, RecordForm::kF16>, prep_tail_kernel<true, RecordForm::kF16>);
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, false, "prep tail kernel", p);
}

}  // namespace flashkda::gpu
