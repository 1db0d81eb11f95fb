// State-pass kernel: the sequential part of the chunked recurrence.
//
// Each warp owns 16 value columns of one (sequence, head) and keeps that slice of the state,
// transposed (S^T [16 v][128 k], the storage layout), in fp32 registers as mma C fragments for
// the whole sequence. Value columns never mix, so the slices of a head need no communication;
// a block holds several slices of one head (or one slice split over warps by key channels) that
// share the chunk records streamed into shared memory by the copy engine (STAGES deep). Per
// chunk, with the record of chunk_record.cuh:
//   X^T = S^T Wk^T,  U^T = WV^T - X^T,  O^T = S^T Qe^T + WV^T M^T,  S^T = S^T D + U^T Kr.
// The products run on the tensor cores in tf32 (fp32 state, records in tf32 or bf16, both exact
// as tf32 operands): C fragments of S^T, X^T and U^T are directly the A fragments of the next
// product, with no conversion. (A bf16 variant needed hi/lo splits of S, U, WV and Kr to stay
// under the 5e-3 bar on large states with little decay, and those splits cost more
// instructions than the products.)
#include <cuda_runtime.h>

#include <type_traits>

#include "api/validate.h"
#include "gpu/launch/per_device.h"
#include "gpu/prefill/chunk_record.cuh"
#include "gpu/prefill/kernels.h"
#include "gpu/ptx/bulk_copy.cuh"
#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/movmatrix.cuh"
#include "gpu/ptx/mma.cuh"

namespace flashkda::gpu {
namespace {

constexpr int kNTiles = kHeadDim / 8;  // 16 n-tiles of 8 key channels

// Calls fn(nt, r, idx) for each pair of this lane's C fragments of state rows [row0, row0 + 16),
// columns [col0, col0 + 8 kTiles): acc[nt][2r], acc[nt][2r + 1] are elements idx, idx + 1 of
// the [.., 128] row-major state.
template <int kTiles, typename Fn>
__device__ __forceinline__ void for_each_state_pair(int64_t row0, int col0, int lane, Fn&& fn) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) fn(nt, r, (row0 + g + 8 * r) * kHeadDim + col0 + nt * 8 + 2 * t4);
}

// Loads this lane's part of the state slice as C fragments (zeros without an initial state).
template <int kTiles>
__device__ __forceinline__ void load_state(float (&acc)[kTiles][4], const void* state, bool f32, int64_t row0,
                                           int col0, int lane) {
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    float2 x = make_float2(0.0f, 0.0f);
    if (state) {
      if (f32) x = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(state) + idx));
      else x = ptx::unpack_bf16x2(__ldg(reinterpret_cast<const unsigned*>(static_cast<const uint16_t*>(state) + idx)));
    }
    acc[nt][2 * r] = x.x;
    acc[nt][2 * r + 1] = x.y;
  });
}

template <int kTiles>
__device__ __forceinline__ void store_state(const float (&acc)[kTiles][4], void* state, bool f32, int64_t row0,
                                            int col0, int lane) {
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    if (f32) *reinterpret_cast<float2*>(static_cast<float*>(state) + idx) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
    else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(state) + idx) = ptx::pack_bf16x2(acc[nt][2 * r], acc[nt][2 * r + 1]);
  });
}

// The identity as the initial state (rows v, columns k): the split pass's A run.
template <int kTiles>
__device__ __forceinline__ void load_identity(float (&acc)[kTiles][4], int64_t row0, int col0, int lane) {
  for_each_state_pair<kTiles>(row0, col0, lane, [&](int nt, int r, int64_t idx) {
    const int64_t v = idx / kHeadDim, k = idx % kHeadDim;
    acc[nt][2 * r] = v == k ? 1.0f : 0.0f;
    acc[nt][2 * r + 1] = v == k + 1 ? 1.0f : 0.0f;
  });
}

// Named barrier over the `threads` threads of one value slice (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void slice_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Exchange area of one value slice: each of the KS warps posts its partial X^T and O^T
// fragments (16 floats a lane) as four float4 stored [vector][lane], conflict-free both ways.
template <int KS>
struct SliceExchange {
  float4 part[KS][4][32];
};

// Byte offsets of this lane's fragment reads inside a chunk record, fixed for the whole
// sequence: every read is one of these registers plus a compile-time immediate.
struct LaneOffsets {
  uint32_t wk;     // Wk entry of this warp's first channel tile, token half 0; + 4096 nt + 256 nl
  uint32_t qe;     // Qe entry, same fragment;                                  + 2048 nt + 128 nl
  uint32_t kr;     // Kr entry of this warp's first channel tile, token half 0; + 256 nl + 128 kt
  uint32_t m[2];   // M and W: row g, token k-tile kt;                          + 512 nt
  uint32_t decay;  // exp(G_C): channel 8 tile0 + 2 t4;                         + 32 nl

  template <int kTiles>
  __device__ __forceinline__ void init(int lane, int kpart) {
    const int g = lane >> 2, t4 = lane & 3, g1 = (g >> 1) & 1;
    const int tile0 = kpart * kTiles;  // first channel tile of this warp
    wk = ChunkRecord::kWk + fragment_entry(tile0, lane, 8);
    qe = ChunkRecord::kQe + fragment_entry(tile0, lane, 4);
    kr = ChunkRecord::kKr + fragment_entry(2 * tile0, lane, 4);
#pragma unroll
    for (int k = 0; k < 2; ++k) m[k] = 4 * (16 * g + 8 * (k ^ g1) + 2 * t4);
    decay = ChunkRecord::kDecay + 4 * (8 * tile0 + 2 * t4);
  }
};

// Two adjacent fp32 elements of a record tile (8-byte aligned by construction).
__device__ __forceinline__ float2 load_pair(const uint8_t* p) { return *reinterpret_cast<const float2*>(p); }

// Two adjacent bf16 elements of a record tile, widened to fp32 (exact in tf32).
__device__ __forceinline__ float2 load_bf16_pair(const uint8_t* p) {
  return ptx::unpack_bf16x2(*reinterpret_cast<const uint32_t*>(p));
}

// One chunk step of one warp: value columns [vbase, vbase + 16), key n-tiles
// [kpart * kTiles, (kpart + 1) * kTiles) of the state slice (kTiles = 16 / KS). All products are
// m16n8k8 tf32 with k-slot t = element 2t and slot t + 4 = element 2t + 1 (see mma.cuh): every C
// fragment is an A fragment as it stands, and every B fragment one shared-memory load (8 bytes
// of fp32 or 4 of bf16, conflict-free in the record's fragment order).
// OutT: uint16_t (bf16 out) or float (the split pass's fp32 partial outputs).
template <int KS, typename OutT>
__device__ __forceinline__ void chunk_step(float (&acc)[kNTiles / KS][4], const uint8_t* rec, const LaneOffsets& o,
                                           int vbase, int kpart, int lane, SliceExchange<KS>* exchange,
                                           int barrier_id, OutT* out_chunk, int count, int64_t out_row_stride) {
  constexpr int kTiles = kNTiles / KS;
  const int g = lane >> 2, t4 = lane & 3;

  // Partial X^T = S^T Wk^T and P = S^T Qe^T over this warp's key channels. A k-tile is one
  // n-tile (8 channels) of S^T. Two accumulators per product and n-tile: four independent mma
  // chains per product, enough beside the other warps of the scheduler (four accumulators
  // measured 8% slower on P1: more registers and adds for no more overlap).
  constexpr int kChains = 2;
  static_assert(kTiles % kChains == 0, "whole chains");
  float X[2][kChains][4] = {};
  float Pc[2][kChains][4] = {};
#pragma unroll
  for (int nl = 0; nl < kTiles; ++nl) {
    uint32_t a[4];
    ptx::tf32_a_from_c(acc[nl], a);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 w = load_pair(rec + o.wk + 4096 * nt + 256 * nl);
      const float2 e = load_bf16_pair(rec + o.qe + 2048 * nt + 128 * nl);
      ptx::mma_tf32_1688(X[nt][nl % kChains], a, w.x, w.y);
      ptx::mma_tf32_1688(Pc[nt][nl % kChains], a, e.x, e.y);
    }
  }
  float Xs[2][4], P[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Xs[nt][i] = X[nt][0][i] + X[nt][1][i];
      P[nt][i] = Pc[nt][0][i] + Pc[nt][1][i];
    }

  if constexpr (KS > 1) {  // sum the partial products of the slice's KS warps (own one included)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      exchange->part[kpart][nt][lane] = make_float4(Xs[nt][0], Xs[nt][1], Xs[nt][2], Xs[nt][3]);
      exchange->part[kpart][2 + nt][lane] = make_float4(P[nt][0], P[nt][1], P[nt][2], P[nt][3]);
    }
    slice_barrier(barrier_id, KS * 32);
    const int parts = kpart == 0 ? 4 : 2;  // only part 0 stores the output and needs all of P
#pragma unroll
    for (int v4 = 0; v4 < 4; ++v4) {
      if (v4 >= parts) break;
      float4 sum = exchange->part[0][v4][lane];
#pragma unroll
      for (int other = 1; other < KS; ++other) {
        const float4 x = exchange->part[other][v4][lane];
        sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
      }
      float(&dst)[4] = v4 < 2 ? Xs[v4] : P[v4 - 2];
      dst[0] = sum.x, dst[1] = sum.y, dst[2] = sum.z, dst[3] = sum.w;
    }
  }

  // (W V)^T = V^T W^T as C fragments (rows v, columns tokens): A = V^T from the chunk's v rows
  // (bf16, exact in tf32; rows past the sequence end are not loaded and read as 0), B = W^T with
  // W split hi + lo (the mma truncates lo to tf32: W V keeps ~21 bits). Then U^T = (W V)^T -
  // X^T, rounded to tf32 as the A fragments (k = tokens) of the state update.
  float wv[2][4] = {};
  const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(rec + ChunkRecord::kBytes);  // [16][128]
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    const int tok = kt * 8 + 2 * t4;
    uint32_t a[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool live = tok + e < count;
      const uint32_t top = live ? uint32_t{v_rows[(tok + e) * kHeadDim + vbase + g]} << 16 : 0u;
      const uint32_t bottom = live ? uint32_t{v_rows[(tok + e) * kHeadDim + vbase + g + 8]} << 16 : 0u;
      a[2 * e] = top;         // a[0] (row g, slot t), a[2] (row g, slot t + 4)
      a[2 * e + 1] = bottom;  // a[1] (row g + 8, slot t), a[3] (row g + 8, slot t + 4)
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 w = load_pair(rec + ChunkRecord::kW + o.m[kt] + 512 * nt);
      const float hi_x = __uint_as_float(__float_as_uint(ptx::tf32_operand(w.x)) & 0xffffe000u);
      const float hi_y = __uint_as_float(__float_as_uint(ptx::tf32_operand(w.y)) & 0xffffe000u);
      ptx::mma_tf32_1688(wv[nt], a, hi_x, hi_y);
      ptx::mma_tf32_1688(wv[nt], a, w.x - hi_x, w.y - hi_y);
    }
  }
  uint32_t ua[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = ptx::tf32_operand(wv[nt][i] - Xs[nt][i]);
    ptx::tf32_a_from_c(u, ua[nt]);
  }

  // S^T = S^T Diag(exp(G_C)) + U^T Kr on this warp's key channels.
#pragma unroll
  for (int nl = 0; nl < kTiles; ++nl) {
    const float2 d = load_pair(rec + o.decay + 32 * nl);
    acc[nl][0] *= d.x;
    acc[nl][1] *= d.y;
    acc[nl][2] *= d.x;
    acc[nl][3] *= d.y;
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
      const float2 b = load_bf16_pair(rec + o.kr + 256 * nl + 128 * kt);
      ptx::mma_tf32_1688(acc[nl], ua[kt], b.x, b.y);
    }
  }

  if (kpart != 0) return;
  // O^T += (W V)^T M^T (the intra-chunk part), then O^T fragments (rows v, columns tokens)
  // transposed in registers to (token, v pair) and stored.
#pragma unroll
  for (int kt = 0; kt < 2; ++kt) {
    uint32_t a[4];
    ptx::tf32_a_from_c(wv[kt], a);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 m = load_pair(rec + ChunkRecord::kM + o.m[kt] + 512 * nt);
      ptx::mma_tf32_1688(P[nt], a, m.x, m.y);
    }
  }
  if constexpr (std::is_same_v<OutT, float>) {  // fp32, straight from the fragments (rows v, columns tokens)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = nt * 8 + 2 * t4 + (i & 1), v = vbase + g + 8 * (i >> 1);
        if (token < count) out_chunk[token * out_row_stride + v] = P[nt][i];
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t ov = ptx::movmatrix_trans(ptx::pack_bf16x2(P[nt][2 * r], P[nt][2 * r + 1]));
        const int token = nt * 8 + g;
        if (token < count)
          *reinterpret_cast<uint32_t*>(out_chunk + token * out_row_stride + vbase + 8 * r + 2 * t4) = ov;
      }
  }
}

// One pipeline stage: the chunk record, then the chunk's 16 rows of v (bf16).
constexpr uint32_t kStageBytes = ChunkRecord::kBytes + kChunk * kHeadDim * 2;

// Fills a stage (one producer thread): the chunk record, and the chunk's 16 v rows of head h
// as one tensor-map tile (rows past the problem's end arrive as zeros).
__device__ __forceinline__ void fill_stage(uint8_t* stage, uint64_t* full, const uint8_t* record,
                                           const CUtensorMap* v_rows, int h, int64_t token0) {
  ptx::mbarrier_arrive_expect_tx(full, kStageBytes);
  ptx::bulk_copy_g2s(stage, record, ChunkRecord::kBytes, full);
  ptx::tensor_copy_3d_g2s(stage + ChunkRecord::kBytes, v_rows, 0, h, static_cast<int>(token0), full);
}

// Block = VW value slices x KS key parts (one warp each) of one (sequence, head), plus one
// producer warp that keeps STAGES chunks in flight: each step waits on its stage, so the copy
// latency must hide behind STAGES - 1 steps, and no computing warp ever waits to refill.
//
// kSplit: the segment-parallel form (StateSplit in kernels.h). Each sequence's chunks are cut at
// mid = ceil(chunks / 2) and blockIdx.y picks the run: 0 runs [0, mid) from the initial state
// (out as usual, final state -> mid_state); 1 runs [mid, end) from zero (out -> out_b, final
// -> b_t); 2 runs [mid, end) from the identity with v = 0 (out -> out_a, final -> a_t). The
// three chains take half as many steps and run at once; the stitch kernel combines them.
template <int VW, int KS, int STAGES, bool kSplit>
__global__ void __launch_bounds__((VW * KS + 1) * 32, 1) state_kernel(const __grid_constant__ StateParams p) {
  constexpr int kStages = STAGES;
  constexpr int kWarps = VW * KS;
  constexpr int kGroups = 8 / VW;  // blocks per head
  constexpr int kTiles = kNTiles / KS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int vslice = warp / KS, kpart = warp % KS;
  const int H = p.num_heads;
  const int64_t head_block = blockIdx.x / kGroups;
  const int h = static_cast<int>(head_block % H);
  const int64_t n = head_block / H;
  const int vbase = (static_cast<int>(blockIdx.x % kGroups) * VW + vslice) * 16;

  int64_t bos, eos;
  p.seqs.bounds(n, bos, eos);
  const int num_chunks = static_cast<int>((eos - bos + kChunk - 1) / kChunk);  // < 2^31 tokens
  int c_begin = 0, c_end = num_chunks;  // the chunks this block runs
  const int run = kSplit ? static_cast<int>(blockIdx.y) : 0;
  if constexpr (kSplit) (run == 0 ? c_end : c_begin) = (num_chunks + 1) / 2;
  const int64_t slot0 = p.seqs.first_slot(n, bos);
  const int64_t record_stride = static_cast<int64_t>(H) * ChunkRecord::kBytes;
  const uint8_t* records = p.records + slot0 * record_stride + static_cast<int64_t>(h) * ChunkRecord::kBytes;

  // Dynamic shared memory: kStages stages, then (KS > 1) two exchange areas per slice.
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // Tensor-map copies need 128-byte aligned destinations: align by hand (kSmem has the slack).
  uint8_t* smem = smem_raw + ((128 - (ptx::smem_addr(smem_raw) & 127)) & 127);
  auto* exchange = reinterpret_cast<SliceExchange<KS>*>(smem + kStages * kStageBytes);
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kWarps * 32);  // every consumer thread releases the stage
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  auto chunk_count = [&](int c) {
    const int64_t left = eos - bos - int64_t{c} * kChunk;
    return static_cast<int>(left < kChunk ? left : kChunk);
  };
  if (warp == kWarps) {  // producer
    if (lane != 0) return;
    int s = 0;
    uint32_t parity = 0;
    // The A run reads v as zeros: a tile that starts at the problem's end is all padding.
    const bool zero_v = kSplit && run == 2;
    for (int c = c_begin; c < c_end; ++c) {
      if (c - c_begin >= kStages) ptx::mbarrier_wait_parity(&empty[s], parity ^ 1);  // released kStages ago
      fill_stage(smem + s * kStageBytes, &full[s], records + int64_t{c} * record_stride, &p.v_rows, h,
                 zero_v ? p.seqs.total_tokens : bos + int64_t{c} * kChunk);
      if (++s == kStages) {
        s = 0;
        parity ^= 1;
      }
    }
    return;
  }

  const int64_t state_row0 = (n * H + h) * static_cast<int64_t>(kHeadDim) + vbase;
  const int col0 = kpart * kTiles * 8;
  float acc[kTiles][4];
  if (!kSplit || run == 0) load_state(acc, p.initial_state, p.initial_state_f32, state_row0, col0, lane);
  else if (run == 1) load_state(acc, nullptr, false, state_row0, col0, lane);  // zeros
  else load_identity(acc, vbase, col0, lane);

  LaneOffsets offsets;
  offsets.init<kTiles>(lane, kpart);
  const int64_t out_row_stride = static_cast<int64_t>(H) * kHeadDim;
  auto run_chunks = [&](auto* out) {
    auto* out_head = out + bos * out_row_stride + h * kHeadDim;
    int s = 0;
    uint32_t parity = 0;
    for (int c = c_begin; c < c_end; ++c) {
      ptx::mbarrier_wait_parity(&full[s], parity);
      // Exchange areas alternate by chunk: a slice's warps meet at one barrier per chunk, and
      // a warp writing area (c & 1) knows every partner has finished reading it at chunk c - 2.
      chunk_step<KS>(acc, smem + s * kStageBytes, offsets, vbase, kpart, lane, exchange + (c & 1) * VW + vslice,
                     1 + vslice, out_head + int64_t{c} * kChunk * out_row_stride, chunk_count(c), out_row_stride);
      ptx::mbarrier_arrive(&empty[s]);  // this thread's reads of the stage are done
      if (++s == kStages) {
        s = 0;
        parity ^= 1;
      }
    }
  };
  if (!kSplit || run == 0) run_chunks(p.out);
  else run_chunks(run == 1 ? p.split.out_b : p.split.out_a);

  if constexpr (kSplit) {
    float* const final_state = run == 0 ? p.split.mid_state : run == 1 ? p.split.b_t : p.split.a_t;
    store_state(acc, final_state, true, state_row0, col0, lane);
  } else if (p.final_state) {
    store_state(acc, p.final_state, p.final_state_f32, state_row0, col0, lane);
  }
}

template <int VW, int KS, int STAGES, bool kSplit>
void launch_state_config(const StateParams& p, cudaStream_t stream) {
  constexpr int kSmem = 128 + STAGES * kStageBytes + (KS > 1 ? 2 * VW * sizeof(SliceExchange<KS>) : 0);
  static PerDeviceOnce raised;  // the shared-memory limit, raised once per device the caller uses
  raised.run("state kernel: setting its shared memory size", [] {
    return cudaFuncSetAttribute(state_kernel<VW, KS, STAGES, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kSmem);
  });
  const int64_t blocks = p.seqs.num_seqs * p.num_heads * (8 / VW);
  const dim3 grid(static_cast<unsigned>(blocks), kSplit ? 3 : 1);
  state_kernel<VW, KS, STAGES, kSplit><<<grid, (VW * KS + 1) * 32, kSmem, stream>>>(p);
}

}  // namespace

void launch_state(const StateParams& p, StateConfig config, cudaStream_t stream) {
  // Stages: as many 31.5 KB stages as shared memory holds at the blocks per multiprocessor that
  // the layout is meant to run (8x1, 2x2 and 1x4: one block, 6/3/6 stages; 4x1: two blocks, 3).
  if (p.split.mid_state) {  // the segment-parallel form exists for the few-heads layout only
    if (config.value_slices != 1 || config.key_parts != 4)
      fail(ErrorCode::kInternal, "state kernel: the split pass runs the 1x4 layout only");
    launch_state_config<1, 4, 6, true>(p, stream);
  } else if (config.value_slices == 8 && config.key_parts == 1) launch_state_config<8, 1, 6, false>(p, stream);
  else if (config.value_slices == 4 && config.key_parts == 1) launch_state_config<4, 1, 3, false>(p, stream);
  else if (config.value_slices == 2 && config.key_parts == 2) launch_state_config<2, 2, 3, false>(p, stream);
  else if (config.value_slices == 1 && config.key_parts == 4) launch_state_config<1, 4, 6, false>(p, stream);
  else
    fail(ErrorCode::kInternal, "state kernel: unsupported configuration ", config.value_slices, " x ",
         config.key_parts);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail(ErrorCode::kCudaError, "state kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace flashkda::gpu
