// fp64 references of docs/contract.md: the per-token definition (oracle_forward) and the chunked form
// (oracle_forward_chunked). Both read the same bf16 / fp32 inputs as every other path, convert
// them exactly to double and do all arithmetic in double. They favour clarity over speed; the
// only concession to speed is running the (sequence, head) pairs on a few threads.
#include "cpu/oracle.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "common/gate.h"

namespace flashkda {
namespace {

// Runs fn(i) for i in [0, count) on up to hardware_concurrency() threads (dynamic split).
template <typename Fn>
void parallel_for(int64_t count, const Fn& fn) {
  if (count <= 0) return;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>(hw, count);
  if (workers == 1) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto loop = [&]() {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(loop);
  loop();
  for (auto& t : threads) t.join();
}

// The initial state of sequence n, head h, as S[j * K + i] = S_{i j} (key i, value j) in double
// (zeros when there is none), from its slot in either layout.
void load_initial_state(const Problem& p, const StateSlots& slots, int64_t slot, int64_t h, std::vector<double>& S) {
  const int64_t K = p.K, V = p.V;
  for (int64_t j = 0; j < V; ++j)
    for (int64_t i = 0; i < K; ++i) {
      double x = 0.0;
      if (p.initial_state) {
        const int64_t e = slots.element(slot, h, j, i);
        x = p.initial_state_dtype == DType::kBF16 ? bf16_to_float(static_cast<const uint16_t*>(p.initial_state)[e])
                                                  : static_cast<const float*>(p.initial_state)[e];
      }
      S[static_cast<size_t>(j * K + i)] = x;
    }
}

// x / sqrt(sum(x^2) + 1e-6) of one bf16 row of length n, in double.
void normalised_row(const uint16_t* x, int64_t n, double* dst) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = bf16_to_float(x[i]);
    ss += dst[i] * dst[i];
  }
  const double inv = 1.0 / std::sqrt(ss + 1e-6);
  for (int64_t i = 0; i < n; ++i) dst[i] *= inv;
}

// The per-token inputs of one (token, head): normalised q and k, log-decay a, beta.
struct TokenInputs {
  std::vector<double> q, k, a, v;
  double beta = 0.0;
  TokenInputs(int64_t K, int64_t V) : q(K), k(K), a(K), v(V) {}

  void load(const Problem& p, int64_t t, int64_t h) {
    const int64_t K = p.K, V = p.V;
    normalised_row(p.q + p.row_offset(p.q_rows, t, h, K), K, q.data());
    normalised_row(p.k + p.row_offset(p.k_rows, t, h, K), K, k.data());
    const double A_log = p.A_log[h];
    for (int64_t i = 0; i < K; ++i) {
      const double g = bf16_to_float(p.g[p.row_offset(p.g_rows, t, h, K) + i]);
      a[i] = gate_log_decay<double>(p.gate, g, A_log, static_cast<double>(p.dt_bias[h * K + i]),
                                    static_cast<double>(p.lower_bound));
    }
    for (int64_t j = 0; j < V; ++j) v[j] = bf16_to_float(p.v[p.row_offset(p.v_rows, t, h, V) + j]);
    beta = sigmoid<double>(bf16_to_float(p.beta[p.row_offset(p.beta_rows, t, h, 1)]));
  }
};

}  // namespace

void oracle_forward(const Problem& p, double* out, double* final_state) {
  const std::vector<int64_t> offsets = host_sequence_offsets(p);
  const StateSlots slots(p);
  const int64_t H = p.H, K = p.K, V = p.V;
  const double scale = p.scale;

  parallel_for(p.N * H, [&](int64_t pair) {
    const int64_t n = pair / H, h = pair % H;
    const int64_t slot = slots.initial(n);
    if (slot < 0) return;  // padding: skipped, nothing written
    const int64_t state_base = (n * H + h) * V * K;  // in the [N, H, V, K] final_state output
    // S is stored transposed, as in memory: S[j * K + i] = S_{i j}, key i, value j.
    std::vector<double> S(static_cast<size_t>(V * K));
    load_initial_state(p, slots, slot, h, S);

    TokenInputs x(K, V);
    std::vector<double> decay(K);
    for (int64_t t = offsets[n]; t < offsets[n + 1]; ++t) {
      x.load(p, t, h);
      for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(x.a[i]);
      for (int64_t j = 0; j < V; ++j) {
        double* col = &S[j * K];  // column j of S (all keys)
        // S' = Diag(exp(a)) S
        for (int64_t i = 0; i < K; ++i) col[i] *= decay[i];
        // S = S' + beta k (v - S'^T k)^T
        double pred = 0.0;
        for (int64_t i = 0; i < K; ++i) pred += col[i] * x.k[i];
        const double delta = x.beta * (x.v[j] - pred);
        for (int64_t i = 0; i < K; ++i) col[i] += delta * x.k[i];
        // o = scale S^T q
        double o = 0.0;
        for (int64_t i = 0; i < K; ++i) o += col[i] * x.q[i];
        out[(t * H + h) * V + j] = scale * o;
      }
    }
    if (final_state != nullptr)
      std::copy(S.begin(), S.end(), final_state + state_base);
  });
}

void oracle_forward_chunked(const Problem& p, int chunk, double* out, double* final_state) {
  const std::vector<int64_t> offsets = host_sequence_offsets(p);
  const StateSlots slots(p);
  const int64_t H = p.H, K = p.K, V = p.V;
  const int64_t C = std::max(1, chunk);
  const double scale = p.scale;

  parallel_for(p.N * H, [&](int64_t pair) {
    const int64_t n = pair / H, h = pair % H;
    const int64_t slot = slots.initial(n);
    if (slot < 0) return;  // padding: skipped, nothing written
    const int64_t state_base = (n * H + h) * V * K;  // in the [N, H, V, K] final_state output
    std::vector<double> S(static_cast<size_t>(V * K));  // S[j * K + i] = S_{i j}
    load_initial_state(p, slots, slot, h, S);

    // Per-chunk arrays, row i = position i inside the chunk.
    std::vector<double> q(C * K), k(C * K), G(C * K), vv(C * V), beta(C);
    std::vector<double> qt(C * K), kt(C * K), kr(C * K), eC(K);
    std::vector<double> L(C * C), M(C * C), U(C * V), O(C * V);
    TokenInputs x(K, V);

    for (int64_t t0 = offsets[n]; t0 < offsets[n + 1]; t0 += C) {
      const int64_t c = std::min(C, offsets[n + 1] - t0);
      for (int64_t r = 0; r < c; ++r) {
        x.load(p, t0 + r, h);
        for (int64_t i = 0; i < K; ++i) {
          q[r * K + i] = x.q[i];
          k[r * K + i] = x.k[i];
          G[r * K + i] = (r > 0 ? G[(r - 1) * K + i] : 0.0) + x.a[i];  // G_r = a_1 + ... + a_r
        }
        for (int64_t j = 0; j < V; ++j) vv[r * V + j] = x.v[j];
        beta[r] = x.beta;
      }
      const double* Gc = &G[(c - 1) * K];

      // L_rs = beta_r sum_i k_ri k_si exp(G_ri - G_si)       (r > s)
      // M_rs = scale sum_i q_ri k_si exp(G_ri - G_si)        (r >= s)
      for (int64_t r = 0; r < c; ++r) {
        for (int64_t s = 0; s < c; ++s) {
          double l = 0.0, m = 0.0;
          if (s <= r) {
            for (int64_t i = 0; i < K; ++i) {
              const double e = std::exp(G[r * K + i] - G[s * K + i]);
              l += k[r * K + i] * k[s * K + i] * e;
              m += q[r * K + i] * k[s * K + i] * e;
            }
          }
          L[r * C + s] = s < r ? beta[r] * l : 0.0;
          M[r * C + s] = s <= r ? scale * m : 0.0;
        }
      }

      // K~_r = k_r exp(G_r), Q~_r = scale q_r exp(G_r), Kr_s = k_s exp(G_C - G_s): every
      // exponent here is <= 0, so these are formed directly.
      for (int64_t r = 0; r < c; ++r) {
        for (int64_t i = 0; i < K; ++i) {
          const double e = std::exp(G[r * K + i]);
          kt[r * K + i] = k[r * K + i] * e;
          qt[r * K + i] = scale * q[r * K + i] * e;
          kr[r * K + i] = k[r * K + i] * std::exp(Gc[i] - G[r * K + i]);
        }
      }
      // u = Diag(beta) (V - K~ S) and the Q~ S part of O.
      for (int64_t r = 0; r < c; ++r) {
        for (int64_t j = 0; j < V; ++j) {
          double ks = 0.0, qs = 0.0;
          for (int64_t i = 0; i < K; ++i) {
            ks += kt[r * K + i] * S[j * K + i];
            qs += qt[r * K + i] * S[j * K + i];
          }
          U[r * V + j] = beta[r] * (vv[r * V + j] - ks);
          O[r * V + j] = qs;
        }
      }
      // U = (I + L)^{-1} u by forward substitution (L strictly lower triangular).
      for (int64_t r = 0; r < c; ++r)
        for (int64_t s = 0; s < r; ++s)
          for (int64_t j = 0; j < V; ++j) U[r * V + j] -= L[r * C + s] * U[s * V + j];
      // O = Q~ S + M U
      for (int64_t r = 0; r < c; ++r) {
        for (int64_t j = 0; j < V; ++j) {
          double o = O[r * V + j];
          for (int64_t s = 0; s <= r; ++s) o += M[r * C + s] * U[s * V + j];
          out[((t0 + r) * H + h) * V + j] = o;
        }
      }
      // S = Diag(exp(G_C)) S + Kr^T U
      for (int64_t i = 0; i < K; ++i) eC[i] = std::exp(Gc[i]);
      for (int64_t j = 0; j < V; ++j) {
        for (int64_t i = 0; i < K; ++i) {
          double s_new = eC[i] * S[j * K + i];
          for (int64_t s = 0; s < c; ++s)
            s_new += kr[s * K + i] * U[s * V + j];
          S[j * K + i] = s_new;
        }
      }
    }
    if (final_state != nullptr)
      std::copy(S.begin(), S.end(), final_state + state_base);
  });
}

}  // namespace flashkda
