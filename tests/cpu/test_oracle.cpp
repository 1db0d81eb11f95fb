// The fp64 oracle: a hand-derived tiny case, and the chunked form against the per-token form.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/bf16.h"
#include "common/random_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/oracle.h"

namespace flashkda {
namespace {

using testing::DtBiasInput;
using testing::GateInput;
using testing::InitState;
using testing::ProblemSpec;
using testing::RandomProblem;
using testing::rel_error;

// ---------------------------------------------------------------------------------------------
// Hand-derived case: B = 1, T = 2, H = 1, K = 2, V = 2, scale = 1.
//
// Inputs (all exact in bf16):
//   token 1: q = (1, 0), k = (1, 0), v = (2, 0.5),  beta_logit = 0
//   token 2: q = (1, 1), k = (0, 1), v = (-1, 3),   beta_logit = 0
//   g = 0, dt_bias = 0, A_log = 0 everywhere.
//   initial state (V-major [V][K]): row v=0: (1, 2), row v=1: (-0.5, 0.25); i.e. the state
//   column of value channel j is (s1, s2) over the two keys.
// Then beta = sigmoid(0) = 1/2 for both tokens, and every key channel has the same decay
// d = exp(a):
//   safe gate, lower_bound = -1:  a = -1 * sigmoid(exp(0) * 0) = -1/2   ->  d = exp(-1/2)
//   softplus gate:                a = -exp(0) * softplus(0) = -ln 2     ->  d = 1/2
// Normalisation: k^1 = q^1 = (c, 0), k^2 = (0, c) with c = 1/sqrt(1 + 1e-6), and
// q^2 = (c2, c2) with c2 = 1/sqrt(2 + 1e-6).
// Value channels never mix, so each column j of S evolves alone. With its start (s1, s2) and
// its values x1 (token 1), x2 (token 2):
//   token 1: S' = (d s1, d s2);  S'^T k^1 = c d s1;
//            S1 = S' + (1/2) k^1 (x1 - c d s1) = (d s1 + (c/2)(x1 - c d s1),  d s2)
//            o1 = S1 . q^1 = c * S1[0]
//   token 2: S' = (d S1[0], d^2 s2);  S'^T k^2 = c d^2 s2;
//            S2 = (d S1[0],  d^2 s2 + (c/2)(x2 - c d^2 s2))
//            o2 = S2 . q^2 = c2 (S2[0] + S2[1])
// E.g. softplus gate (d = 1/2), column 0 (s = (1, 2), x = (2, -1)), taking c ~ 1:
//   S1 = (0.5 + 0.5 * 1.5, 1) = (1.25, 1), o1 = 1.25;
//   S2 = (0.625, 0.5 + 0.5 * (-1.5)) = (0.625, -0.25), o2 = 0.375 / sqrt(2) ~ 0.265165.
// ---------------------------------------------------------------------------------------------
struct HandColumn {
  double o1, o2, S0, S1;  // outputs of tokens 1, 2 and the final state column
};

HandColumn hand_column(double s1, double s2, double x1, double x2, double d) {
  const double c = 1.0 / std::sqrt(1.0 + 1e-6);
  const double c2 = 1.0 / std::sqrt(2.0 + 1e-6);
  const double S1_0 = d * s1 + 0.5 * c * (x1 - c * d * s1);
  const double S1_1 = d * s2;
  const double o1 = c * S1_0;
  const double S2_0 = d * S1_0;
  const double S2_1 = d * S1_1 + 0.5 * c * (x2 - c * d * S1_1);
  const double o2 = c2 * (S2_0 + S2_1);
  return {o1, o2, S2_0, S2_1};
}

struct HandProblem {
  std::vector<uint16_t> q, k, v, g, beta;
  std::vector<float> A_log{0.0f}, dt_bias{0.0f, 0.0f};
  std::vector<float> init{1.0f, 2.0f, -0.5f, 0.25f};
  std::vector<uint16_t> out = std::vector<uint16_t>(4);
  std::vector<float> final_state = std::vector<float>(4);
  Problem p;

  explicit HandProblem(Gate gate) {
    auto bf = [](std::initializer_list<float> xs) {
      std::vector<uint16_t> r;
      for (float x : xs) r.push_back(float_to_bf16(x));
      return r;
    };
    q = bf({1, 0, 1, 1});
    k = bf({1, 0, 0, 1});
    v = bf({2, 0.5f, -1, 3});
    g = bf({0, 0, 0, 0});
    beta = bf({0, 0});
    p.B = 1; p.T = 2; p.H = 1; p.K = 2; p.V = 2; p.N = 1; p.total_tokens = 2;
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.g = g.data(); p.beta = beta.data();
    p.A_log = A_log.data(); p.dt_bias = dt_bias.data();
    p.initial_state = init.data(); p.initial_state_dtype = DType::kF32;
    p.final_state = final_state.data(); p.final_state_dtype = DType::kF32;
    p.out = out.data();
    p.scale = 1.0f;
    p.gate = gate;
    p.lower_bound = -1.0f;
  }
};

void check_hand_case(Gate gate, double d) {
  HandProblem hp(gate);
  const HandColumn c0 = hand_column(1.0, 2.0, 2.0, -1.0, d);
  const HandColumn c1 = hand_column(-0.5, 0.25, 0.5, 3.0, d);
  // out [T][H][V]: (t1 v0, t1 v1, t2 v0, t2 v1); state [V][K]: (v0 k0, v0 k1, v1 k0, v1 k1).
  const double want_out[4] = {c0.o1, c1.o1, c0.o2, c1.o2};
  const double want_state[4] = {c0.S0, c0.S1, c1.S0, c1.S1};

  double out[4], state[4];
  oracle_forward(hp.p, out, state);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(out[i], want_out[i], 1e-12 * std::abs(want_out[i]) + 1e-15) << "out " << i;
    EXPECT_NEAR(state[i], want_state[i], 1e-12 * std::abs(want_state[i]) + 1e-15) << "state " << i;
  }
  for (int chunk : {1, 2, 16}) {
    double co[4], cs[4];
    oracle_forward_chunked(hp.p, chunk, co, cs);
    EXPECT_LT(rel_error(want_out, co, 4), 1e-12) << "chunk " << chunk;
    EXPECT_LT(rel_error(want_state, cs, 4), 1e-12) << "chunk " << chunk;
  }
  // The CPU backend on the same tiny problem (general K, V path; bf16 output).
  cpu_forward(hp.p);
  EXPECT_LT(rel_error(want_out, hp.out.data(), 4), 5e-3);
  EXPECT_LT(rel_error(want_state, hp.final_state.data(), 4), 1e-5);
}

TEST(OracleHand, SafeGate) { check_hand_case(Gate::kSafe, std::exp(-0.5)); }
TEST(OracleHand, SoftplusGate) { check_hand_case(Gate::kSoftplus, 0.5); }

TEST(OracleHand, SoftplusNumbers) {
  // The worked numbers of the comment above (softplus gate, column 0, c ~ 1).
  const HandColumn c0 = hand_column(1.0, 2.0, 2.0, -1.0, 0.5);
  EXPECT_NEAR(c0.o1, 1.25, 1e-5);
  EXPECT_NEAR(c0.S0, 0.625, 1e-5);
  EXPECT_NEAR(c0.S1, -0.25, 1e-5);
  EXPECT_NEAR(c0.o2, 0.375 / std::sqrt(2.0), 1e-5);
}

// No initial state and length 0: final state zero; without final_state nothing is written.
TEST(OracleHand, EmptySequenceKeepsState) {
  ProblemSpec spec;
  spec.H = 2; spec.K = 8; spec.V = 4;
  spec.seqlens = {0, 3, 0};
  spec.init = InitState::kNormal;
  RandomProblem rp(spec);
  std::vector<double> out(rp.out_size()), fs(rp.state_size());
  oracle_forward(rp.problem(), out.data(), fs.data());
  const size_t per_seq = size_t(spec.H * spec.V * spec.K);
  for (size_t e = 0; e < per_seq; ++e) {
    EXPECT_EQ(fs[e], double(rp.init_f32[e]));
    EXPECT_EQ(fs[2 * per_seq + e], double(rp.init_f32[2 * per_seq + e]));
  }
  oracle_forward(rp.problem(), out.data(), nullptr);  // must not crash
}

// A fixed-length batch and the same data packed with cu_seqlens give identical results.
TEST(Oracle, FixedLengthEqualsPacked) {
  ProblemSpec fixed;
  fixed.H = 3; fixed.K = 16; fixed.V = 8; fixed.B = 3; fixed.T = 5;
  fixed.init = InitState::kNormal;
  RandomProblem a(fixed);
  ProblemSpec packed = fixed;
  packed.seqlens = {5, 5, 5};
  RandomProblem b(packed);  // same seed and sizes: same random inputs
  ASSERT_EQ(a.q, b.q);
  std::vector<double> oa(a.out_size()), ob(b.out_size()), sa(a.state_size()), sb(b.state_size());
  oracle_forward(a.problem(), oa.data(), sa.data());
  oracle_forward(b.problem(), ob.data(), sb.data());
  EXPECT_EQ(oa, ob);
  EXPECT_EQ(sa, sb);
}

// ---------------------------------------------------------------------------------------------
// Chunked form vs per-token definition.
// ---------------------------------------------------------------------------------------------
struct ChunkCase {
  ProblemSpec spec;
  int chunk;
};

void check_chunked(const ProblemSpec& spec, int chunk) {
  RandomProblem rp(spec);
  const Problem& p = rp.problem();
  std::vector<double> ro(rp.out_size()), rs(rp.state_size());
  std::vector<double> co(rp.out_size()), cs(rp.state_size());
  oracle_forward(p, ro.data(), rs.data());
  oracle_forward_chunked(p, chunk, co.data(), cs.data());
  const double eo = rel_error(ro.data(), co.data(), ro.size());
  const double es = rel_error(rs.data(), cs.data(), rs.size());
  EXPECT_LE(eo, 1e-10) << spec.describe() << " chunk=" << chunk;
  EXPECT_LE(es, 1e-10) << spec.describe() << " chunk=" << chunk;
  std::printf("  chunk=%2d %-s  out %.2e  state %.2e\n", chunk, spec.describe().c_str(), eo, es);
}

class ChunkedVsOracle : public ::testing::TestWithParam<std::tuple<Gate, int>> {};

TEST_P(ChunkedVsOracle, SingleSequences) {
  const auto [gate, chunk] = GetParam();
  for (int64_t len : {1, 15, 16, 17, 33, 40}) {
    ProblemSpec spec;
    spec.H = 2;
    spec.B = 1;
    spec.T = len;
    spec.gate = gate;
    spec.init = InitState::kNormal;
    spec.seed = 100 + len;
    check_chunked(spec, chunk);
  }
}

TEST_P(ChunkedVsOracle, VarlenBatch) {
  const auto [gate, chunk] = GetParam();
  ProblemSpec spec;
  spec.H = 2;
  spec.seqlens = {0, 1, 15, 16, 17, 3, 33};
  spec.cu_seqlens_dtype = DType::kI32;
  spec.gate = gate;
  spec.init = InitState::kNormal;
  spec.init_dtype = DType::kBF16;
  spec.seed = 7;
  check_chunked(spec, chunk);
}

TEST_P(ChunkedVsOracle, StrongGates) {
  const auto [gate, chunk] = GetParam();
  ProblemSpec spec;
  spec.H = 2;
  spec.B = 2;
  spec.T = 37;
  spec.gate = gate;
  spec.init = InitState::kLarge;
  spec.g_input = GateInput::kUniform8;
  spec.dt_bias_input = DtBiasInput::kWide;
  spec.seed = 11;
  check_chunked(spec, chunk);
  spec.g_input = GateInput::kConstant;
  for (float gc : {-8.0f, 8.0f}) {
    spec.g_const = gc;
    check_chunked(spec, chunk);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Oracle, ChunkedVsOracle,
    ::testing::Combine(::testing::Values(Gate::kSafe, Gate::kSoftplus),
                       ::testing::Values(4, 8, 16)),
    [](const ::testing::TestParamInfo<std::tuple<Gate, int>>& info) {
      return std::string(std::get<0>(info.param) == Gate::kSafe ? "Safe" : "Softplus") +
             "_C" + std::to_string(std::get<1>(info.param));
    });

}  // namespace
}  // namespace flashkda
