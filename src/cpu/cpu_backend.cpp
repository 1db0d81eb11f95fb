// The CPU backend: the chunked form of docs/contract.md with chunk C = 16, fp32 arithmetic, one
// (sequence, head) pair at a time per thread.
//
// Layout. Inside this file the state of one (sequence, head) is a contiguous fp32 array in
// key-major order, St[i * V + j] = S_{i j} (key i, value j), i.e. the transpose of the public
// V-major [V, K] layout; it is transposed on load and store. With it, every product with the
// state is a sum of scaled 128-wide rows,
//     (K~ S)_r  = sum_i K~_ri St[i, :]          S <- Diag(exp(G_C)) S + sum_s Kr_s (x) U_s,
// loops that vectorise without reassociating a floating-point sum (the file is built without
// -ffast-math, so the compiler never vectorises a plain reduction). The few true reductions
// (L, M, the norms) use explicit 8-lane partial sums that the compiler maps to one register.
//
// Gates. L and M are formed from exp(G_r - G_s) directly for both gates (exponent <= 0, so
// this cannot overflow, also for the unbounded softplus gate); every other exponential also
// has an exponent <= 0. exp() in the inner loops is a branch-free, vectorisable fp32 version
// (relative error ~2e-7 over the range used); the gate activations are computed with it too
// (gate_row below, same formulas as common/gate.h), so no libm call remains per element.
//
// Threads: std::thread::hardware_concurrency() workers take (sequence, head) pairs from an
// atomic counter, longest sequences first; each worker owns its scratch and state.
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "common/gate.h"

namespace flashkda {
namespace {

constexpr int kChunk = 16;
constexpr int kLanes = 8;  // width of the explicit partial sums (one AVX2 register)

// exp(x), branch-free so that loops calling it vectorise. x is first clamped to [-87, 88] (so
// exp of anything below -87 gives exp(-87) ~ 1.6e-38 instead of ~0, which is harmless here);
// the clamp works on the bit pattern because a floating-point select followed by arithmetic
// is not if-converted under the default -ftrapping-math. A NaN is not clamped into a number:
// the polynomial runs on 0 and the NaN itself is added to the result (selected as bits, +0
// otherwise), as the oracle's exp would return it. Then Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2/2, a degree-6 Taylor polynomial (truncation ~1e-7 relative) and 2^n built in the
// exponent bits.
inline float exp_f32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t carry_bits = nan ? u : 0u;
  const uint32_t cap = (u >> 31) ? 0xC2AE0000u /* -87.0f */ : 0x42B00000u /* 88.0f */;
  u = u > cap ? cap : u;  // same sign, larger magnitude: the bound
  u = nan ? 0u : u;       // keeps the integer conversion below away from NaN
  std::memcpy(&x, &u, sizeof x);
  float nan_carry;
  std::memcpy(&nan_carry, &carry_bits, sizeof nan_carry);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  float r = x - n * 0.693145751953125f;  // ln2 split in a short head and a tail
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale + nan_carry;
}

// log(1 + z) for z in [0, 1]: 2 atanh(s) with s = z / (2 + z) in [0, 1/3], odd series to s^17
// (truncation < 1e-9 relative), accurate also for tiny z. Branch-free.
inline float log1p_unit(float z) {
  const float s = z / (2.0f + z);
  const float s2 = s * s;
  float p = 1.0f / 17.0f;
  p = p * s2 + 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return 2.0f * s * p;
}

// A decay of exp(-100) per token is 0 in fp32 already, as is any stronger one; clamping the
// unbounded softplus gate there keeps the in-chunk sums G finite (an infinite decay would make
// G_r - G_s = -inf + inf = NaN where the per-token definition simply resets the state).
constexpr float kMinLogDecay = -100.0f;

// The log-decay a of K channels (docs/contract.md, common/gate.h), in a form the compiler vectorises.
// exp_A = exp(A_log[h]).
//   safe:      a = lower_bound * sigmoid(exp_A x) = lower_bound / (1 + exp(-exp_A x))
//   softplus:  a = -exp_A softplus(x),  softplus(x) = max(x, 0) + log1p(exp(-|x|))
// with x = g + dt_bias. max(x, 0) is written (x + |x|) / 2, exact, to stay select-free.
inline void gate_row(Gate gate, const uint16_t* __restrict g, const float* __restrict dt_bias,
                     float exp_A, float lower_bound, float* __restrict a, int n) {
  if (gate == Gate::kSafe) {
    for (int i = 0; i < n; ++i) {
      const float x = bf16_to_float(g[i]) + dt_bias[i];
      a[i] = lower_bound / (1.0f + exp_f32(-exp_A * x));
    }
  } else {
    for (int i = 0; i < n; ++i) {
      // -inf becomes -FLT_MAX (softplus 0 either way) so that (x + |x|) / 2 is 0, not NaN.
      uint32_t u = std::bit_cast<uint32_t>(bf16_to_float(g[i]) + dt_bias[i]);
      u = u == 0xFF800000u ? 0xFF7FFFFFu : u;
      const float x = std::bit_cast<float>(u);
      const float ax = std::fabs(x);
      const float ai = -exp_A * (0.5f * (x + ax) + log1p_unit(exp_f32(-ax)));
      a[i] = ai < kMinLogDecay ? kMinLogDecay : ai;  // NaN compares false and stays
    }
  }
}

template <int N>
inline float dot_fixed(const float* __restrict a, const float* __restrict b) {
  static_assert(N % kLanes == 0);
  float acc[kLanes] = {};
  for (int i = 0; i < N; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

inline float dot_any(const float* __restrict a, const float* __restrict b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Head sizes known at compile time (KC, VC > 0) or at run time (0).
template <int KC, int VC>
struct Dims {
  int K, V;
  Dims(int k, int v) : K(KC > 0 ? KC : k), V(VC > 0 ? VC : v) {}
  int k() const { return KC > 0 ? KC : K; }
  int v() const { return VC > 0 ? VC : V; }
  float dot_k(const float* a, const float* b) const {
    if constexpr (KC > 0 && KC % kLanes == 0) return dot_fixed<KC>(a, b);
    return dot_any(a, b, k());
  }
};

// Scratch of one worker thread, reused across (sequence, head) pairs.
struct Scratch {
  std::vector<float> St;                   // [K][V] state
  std::vector<float> qh, kh, G;            // [C][K] normalised q, k; cumulative log-decay
  std::vector<float> qt, kt, kr;           // [C][K] Q~, K~, Kr
  std::vector<float> eC, tmp;              // [K]
  std::vector<float> W, O;                 // [C][V]: K~ S (then u, then U), Q~ S (then O)
  std::vector<float> L, M, beta;           // [C][C], [C][C], [C]

  Scratch(int K, int V)
      : St(size_t(K) * V), qh(kChunk * K), kh(kChunk * K), G(kChunk * K), qt(kChunk * K),
        kt(kChunk * K), kr(kChunk * K), eC(K), tmp(K), W(kChunk * V), O(kChunk * V),
        L(kChunk * kChunk), M(kChunk * kChunk), beta(kChunk) {}
};

inline void load_row_bf16(const uint16_t* __restrict src, float* __restrict dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// x /= sqrt(sum(x^2) + 1e-6), fp32 sums.
template <typename D>
inline void normalise(float* x, const D& d) {
  const float ss = d.dot_k(x, x);
  const float inv = 1.0f / std::sqrt(ss + 1e-6f);
  const int K = d.k();
  for (int i = 0; i < K; ++i) x[i] *= inv;
}

template <int KC, int VC>
void run_pair(const Problem& p, int64_t n, int64_t h, int64_t t_begin, int64_t t_end,
              Scratch& s) {
  const Dims<KC, VC> d(static_cast<int>(p.K), static_cast<int>(p.V));
  const int K = d.k(), V = d.v();
  const int64_t H = p.H;
  const float scale = p.scale;
  float* __restrict St = s.St.data();

  // Initial state (its slot, in either layout), as key-major St [K][V].
  const StateSlots slots(p);
  const int64_t slot = slots.initial(n);
  if (slot < 0) return;  // padding: nothing is written for this sequence
  if (p.initial_state == nullptr) {
    std::fill(s.St.begin(), s.St.end(), 0.0f);
  } else if (p.initial_state_dtype == DType::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(p.initial_state);
    for (int j = 0; j < V; ++j)
      for (int i = 0; i < K; ++i) St[i * V + j] = bf16_to_float(src[slots.element(slot, h, j, i)]);
  } else {
    const float* src = static_cast<const float*>(p.initial_state);
    for (int j = 0; j < V; ++j)
      for (int i = 0; i < K; ++i) St[i * V + j] = src[slots.element(slot, h, j, i)];
  }

  // The state as it stands into slot `into` of a state tensor (final_state's pool, or the
  // checkpoints indexed n * C + c), in that tensor's dtype and the state layout.
  auto store_state = [&](void* dst, DType dtype, int64_t into) {
    if (dtype == DType::kBF16) {
      uint16_t* d16 = static_cast<uint16_t*>(dst);
      for (int j = 0; j < V; ++j)
        for (int i = 0; i < K; ++i) d16[slots.element(into, h, j, i)] = float_to_bf16(St[i * V + j]);
    } else {
      float* d32 = static_cast<float*>(dst);
      for (int j = 0; j < V; ++j)
        for (int i = 0; i < K; ++i) d32[slots.element(into, h, j, i)] = St[i * V + j];
    }
  };
  // Prefix checkpoints of this sequence after `offset` tokens (chunks start at the sequence's
  // start, so every multiple of 16 is a chunk boundary, and the state there is the one a prefill
  // of those tokens ends with). The offsets are read once, not at every chunk.
  std::vector<int64_t> checkpoint_at(static_cast<size_t>(p.checkpoint_state ? p.checkpoints : 0));
  for (size_t c = 0; c < checkpoint_at.size(); ++c) checkpoint_at[c] = host_checkpoint_offset(p, n, int64_t(c));
  auto store_checkpoints = [&](int64_t offset) {
    for (size_t c = 0; c < checkpoint_at.size(); ++c)
      if (checkpoint_at[c] == offset) store_state(p.checkpoint_state, DType::kF32, n * p.checkpoints + int64_t(c));
  };
  store_checkpoints(0);
  // Per-token states (speculative verify) need the state after every token: one-token chunks.
  const int64_t step = p.token_state_indices ? 1 : kChunk;

  const float exp_A = std::exp(p.A_log[h]);
  const float* dt_bias = p.dt_bias + h * K;
  float* __restrict qh = s.qh.data();
  float* __restrict kh = s.kh.data();
  float* __restrict G = s.G.data();
  float* __restrict qt = s.qt.data();
  float* __restrict kt = s.kt.data();
  float* __restrict kr = s.kr.data();
  float* __restrict eC = s.eC.data();
  float* __restrict tmp = s.tmp.data();
  float* __restrict W = s.W.data();
  float* __restrict O = s.O.data();
  float* __restrict L = s.L.data();
  float* __restrict M = s.M.data();
  float* __restrict beta = s.beta.data();

  for (int64_t t0 = t_begin; t0 < t_end; t0 += step) {
    const int c = static_cast<int>(std::min<int64_t>(step, t_end - t0));

    // Per-token inputs: normalised q, k; G_r = a_1 + ... + a_r; beta.
    for (int r = 0; r < c; ++r) {
      const int64_t t = t0 + r;
      float* qrow = qh + r * K;
      float* krow = kh + r * K;
      load_row_bf16(p.q + p.row_offset(p.q_rows, t, h, K), qrow, K);
      load_row_bf16(p.k + p.row_offset(p.k_rows, t, h, K), krow, K);
      normalise(qrow, d);
      normalise(krow, d);
      float* __restrict Gr = G + r * K;
      gate_row(p.gate, p.g + p.row_offset(p.g_rows, t, h, K), dt_bias, exp_A, p.lower_bound, Gr, K);
      if (r > 0) {
        const float* __restrict Gprev = G + (r - 1) * K;
        for (int i = 0; i < K; ++i) Gr[i] += Gprev[i];
      }
      beta[r] = sigmoid<float>(bf16_to_float(p.beta[p.row_offset(p.beta_rows, t, h, 1)]));
    }
    const float* Gc = G + (c - 1) * K;

    // Q~_r = scale q_r exp(G_r), K~_r = k_r exp(G_r), Kr_r = k_r exp(G_C - G_r).
    for (int r = 0; r < c; ++r) {
      const float* __restrict Gr = G + r * K;
      const float* __restrict qrow = qh + r * K;
      const float* __restrict krow = kh + r * K;
      float* __restrict qtr = qt + r * K;
      float* __restrict ktr = kt + r * K;
      float* __restrict krr = kr + r * K;
      for (int i = 0; i < K; ++i) {
        const float e = exp_f32(Gr[i]);
        qtr[i] = scale * qrow[i] * e;
        ktr[i] = krow[i] * e;
      }
      for (int i = 0; i < K; ++i) krr[i] = krow[i] * exp_f32(Gc[i] - Gr[i]);
    }
    for (int i = 0; i < K; ++i) eC[i] = exp_f32(Gc[i]);

    // L_rs = beta_r (k_r . k_s exp(G_r - G_s)) for r > s; M_rs = scale (q_r . k_s exp(G_r - G_s))
    // for r >= s, with exp(G_r - G_s) formed directly (exponent <= 0 for every gate).
    for (int r = 0; r < c; ++r) {
      const float* Gr = G + r * K;
      for (int s2 = 0; s2 < r; ++s2) {
        const float* Gs = G + s2 * K;
        const float* ks = kh + s2 * K;
        for (int i = 0; i < K; ++i) tmp[i] = ks[i] * exp_f32(Gr[i] - Gs[i]);
        L[r * kChunk + s2] = beta[r] * d.dot_k(kh + r * K, tmp);
        M[r * kChunk + s2] = scale * d.dot_k(qh + r * K, tmp);
      }
      M[r * kChunk + r] = scale * d.dot_k(qh + r * K, kh + r * K);
    }

    // W = K~ S and O = Q~ S, as sums of scaled state rows, four rows per pass (each pass
    // loads a W and an O row once for eight multiply-adds).
    std::fill(W, W + c * V, 0.0f);
    std::fill(O, O + c * V, 0.0f);
    int i = 0;
    for (; i + 4 <= K; i += 4) {
      const float* __restrict S0 = St + i * V;
      const float* __restrict S1 = S0 + V;
      const float* __restrict S2 = S1 + V;
      const float* __restrict S3 = S2 + V;
      for (int r = 0; r < c; ++r) {
        const float* ktr = kt + r * K + i;
        const float* qtr = qt + r * K + i;
        const float a0 = ktr[0], a1 = ktr[1], a2 = ktr[2], a3 = ktr[3];
        const float b0 = qtr[0], b1 = qtr[1], b2 = qtr[2], b3 = qtr[3];
        float* __restrict Wr = W + r * V;
        float* __restrict Or = O + r * V;
        for (int j = 0; j < V; ++j) {
          Wr[j] += a0 * S0[j] + a1 * S1[j] + a2 * S2[j] + a3 * S3[j];
          Or[j] += b0 * S0[j] + b1 * S1[j] + b2 * S2[j] + b3 * S3[j];
        }
      }
    }
    // K remainder (K not a multiple of 4); a fixed-K instantiation has none, and compiling the
    // dead loop there only makes GCC warn about it.
    static_assert(KC % 4 == 0, "a fixed K must be a multiple of 4");
    if constexpr (KC == 0) for (; i < K; ++i) {
      const float* __restrict Si = St + i * V;
      for (int r = 0; r < c; ++r) {
        const float a = kt[r * K + i], b = qt[r * K + i];
        float* __restrict Wr = W + r * V;
        float* __restrict Or = O + r * V;
        for (int j = 0; j < V; ++j) {
          Wr[j] += a * Si[j];
          Or[j] += b * Si[j];
        }
      }
    }

    // u = Diag(beta) (V - K~ S), then U = (I + L)^{-1} u by forward substitution (in W).
    for (int r = 0; r < c; ++r) {
      const uint16_t* vr = p.v + p.row_offset(p.v_rows, t0 + r, h, V);
      float* __restrict Ur = W + r * V;
      const float b = beta[r];
      for (int j = 0; j < V; ++j) Ur[j] = b * (bf16_to_float(vr[j]) - Ur[j]);
      for (int s2 = 0; s2 < r; ++s2) {
        const float l = L[r * kChunk + s2];
        const float* __restrict Us = W + s2 * V;
        for (int j = 0; j < V; ++j) Ur[j] -= l * Us[j];
      }
    }

    // O = Q~ S + M U, written as bf16.
    for (int r = 0; r < c; ++r) {
      float* __restrict Or = O + r * V;
      for (int s2 = 0; s2 <= r; ++s2) {
        const float m = M[r * kChunk + s2];
        const float* __restrict Us = W + s2 * V;
        for (int j = 0; j < V; ++j) Or[j] += m * Us[j];
      }
      uint16_t* dst = p.out + ((t0 + r) * H + h) * V;
      for (int j = 0; j < V; ++j) dst[j] = float_to_bf16(Or[j]);
    }

    // S = Diag(exp(G_C)) S + Kr^T U, four tokens per pass.
    for (int i2 = 0; i2 < K; ++i2) {
      float* __restrict Si = St + i2 * V;
      const float e = eC[i2];
      for (int j = 0; j < V; ++j) Si[j] *= e;
      int s2 = 0;
      for (; s2 + 4 <= c; s2 += 4) {
        const float a0 = kr[s2 * K + i2], a1 = kr[(s2 + 1) * K + i2];
        const float a2 = kr[(s2 + 2) * K + i2], a3 = kr[(s2 + 3) * K + i2];
        const float* __restrict U0 = W + s2 * V;
        const float* __restrict U1 = U0 + V;
        const float* __restrict U2 = U1 + V;
        const float* __restrict U3 = U2 + V;
        for (int j = 0; j < V; ++j) Si[j] += a0 * U0[j] + a1 * U1[j] + a2 * U2[j] + a3 * U3[j];
      }
      for (; s2 < c; ++s2) {
        const float a = kr[s2 * K + i2];
        const float* __restrict Us = W + s2 * V;
        for (int j = 0; j < V; ++j) Si[j] += a * Us[j];
      }
    }
    store_checkpoints(t0 + c - t_begin);
    if (p.token_state_indices)
      if (const int64_t into = slots.token(n, t0 - t_begin); into >= 0) store_state(p.final_state, p.final_state_dtype, into);
  }

  // Final state, to its slot in the tensor's layout.
  if (const int64_t into = slots.final(n); p.final_state != nullptr && into >= 0)
    store_state(p.final_state, p.final_state_dtype, into);
}

using PairFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, Scratch&);

}  // namespace

void cpu_forward(const Problem& p) {
  const std::vector<int64_t> offsets = host_sequence_offsets(p);
  const int64_t pairs = p.N * p.H;
  if (pairs <= 0) return;

  PairFn fn = (p.K == 128 && p.V == 128) ? &run_pair<128, 128> : &run_pair<0, 0>;

  // Longest sequences first, so that the dynamic split ends evenly.
  std::vector<int64_t> order(static_cast<size_t>(p.N));
  for (int64_t n = 0; n < p.N; ++n) order[n] = n;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return offsets[a + 1] - offsets[a] > offsets[b + 1] - offsets[b];
  });

  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch scratch(static_cast<int>(p.K), static_cast<int>(p.V));
    for (int64_t w = next.fetch_add(1); w < pairs; w = next.fetch_add(1)) {
      const int64_t n = order[w / p.H], h = w % p.H;
      fn(p, n, h, offsets[n], offsets[n + 1], scratch);
    }
  };

  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>(hw, pairs);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int64_t t = 1; t < workers; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

}  // namespace flashkda
