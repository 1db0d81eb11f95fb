// State pools on the CPU backend, through the public API, against the fp64 oracle: sequences read
// and write shuffled slots of a pool (V-major or K-major, bf16 or fp32, int32 or int64 indices),
// padding sequences are skipped, slots not addressed stay bit for bit as they were; bad indices
// are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/random_problem.h"
#include "common/run_forward.h"
#include "cpu/oracle.h"

namespace flashkda {
namespace {

using testing::InitState;
using testing::ProblemSpec;
using testing::RandomProblem;
using testing::rel_error;
using ::testing::HasSubstr;

using testing::kBar;
constexpr unsigned char kPoison = 0xA5;

struct PoolCase {
  StateLayout layout = StateLayout::kVK;
  DType state_dtype = DType::kF32;
  DType index_dtype = DType::kI64;
  bool in_place = true;       // final_state is the initial pool, same slots
  bool has_initial = true;    // without: sequences start from zero, final states go to their slots
  std::vector<int> padding;   // sequences given a negative index
};

// A pool of `slots` states with the random problem's N initial states scattered over shuffled
// slots (transposed for K-major), every other slot a bit pattern that must survive untouched.
class Pool {
 public:
  Pool(const RandomProblem& rp, int64_t slots, const std::vector<int64_t>& slot_of, StateLayout layout, DType dtype)
      : elems_(static_cast<size_t>(rp.problem().H * rp.problem().V * rp.problem().K)),
        bytes_(slots * elems_ * dtype_size(dtype)),
        data_(bytes_, kPoison) {
    const Problem& p = rp.problem();
    for (int64_t n = 0; n < p.N; ++n) {
      if (slot_of[n] < 0 || !p.initial_state) continue;
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t v = 0; v < p.V; ++v)
          for (int64_t k = 0; k < p.K; ++k) {
            const size_t src = static_cast<size_t>(((n * p.H + h) * p.V + v) * p.K + k);
            const size_t base = static_cast<size_t>((slot_of[n] * p.H + h) * p.V * p.K);
            const size_t dst = base + (layout == StateLayout::kVK ? v * p.K + k : k * p.V + v);
            if (dtype == DType::kBF16) reinterpret_cast<uint16_t*>(data_.data())[dst] = rp.init_bf16[src];
            else reinterpret_cast<float*>(data_.data())[dst] = rp.init_f32[src];
          }
    }
  }
  void* data() { return data_.data(); }
  const std::vector<unsigned char>& bytes() const { return data_; }
  // Element (v, k) of head h in `slot`, as a double.
  double at(const Problem& p, int64_t slot, int64_t h, int64_t v, int64_t k, StateLayout layout, DType dtype) const {
    const size_t base = static_cast<size_t>((slot * p.H + h) * p.V * p.K);
    const size_t e = base + (layout == StateLayout::kVK ? v * p.K + k : k * p.V + v);
    return dtype == DType::kBF16 ? bf16_to_float(reinterpret_cast<const uint16_t*>(data_.data())[e])
                                 : reinterpret_cast<const float*>(data_.data())[e];
  }
  size_t slot_bytes(DType dtype) const { return elems_ * dtype_size(dtype); }

 private:
  size_t elems_, bytes_;
  std::vector<unsigned char> data_;
};

std::vector<unsigned char> index_bytes(const std::vector<int64_t>& idx, DType dtype) {
  std::vector<unsigned char> b(idx.size() * dtype_size(dtype));
  for (size_t i = 0; i < idx.size(); ++i) {
    if (dtype == DType::kI32) reinterpret_cast<int32_t*>(b.data())[i] = static_cast<int32_t>(idx[i]);
    else reinterpret_cast<int64_t*>(b.data())[i] = idx[i];
  }
  return b;
}

void run_pool_case(const PoolCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "layout " << (c.layout == StateLayout::kVK ? "VK" : "KV") << ", "
                                    << dtype_name(c.state_dtype) << " pool, " << dtype_name(c.index_dtype)
                                    << " indices, " << (c.in_place ? "in place" : "separate final pool")
                                    << (c.has_initial ? "" : ", no initial state") << ", " << c.padding.size()
                                    << " padding");
  ProblemSpec spec;
  spec.H = 2;
  spec.seqlens = {37, 0, 16, 50, 5};
  spec.init = c.has_initial ? InitState::kNormal : InitState::kNone;
  spec.init_dtype = spec.final_dtype = c.state_dtype;
  spec.seed = seed;
  RandomProblem rp(spec);
  const Problem& base = rp.problem();
  const int64_t N = base.N, slots = N + 4;

  std::mt19937_64 rng(seed);
  std::vector<int64_t> perm(static_cast<size_t>(slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> initial_slot(perm.begin(), perm.begin() + N);
  for (int n : c.padding) initial_slot[n] = -1 - n;  // any negative value is padding
  std::vector<int64_t> final_slot = initial_slot;
  if (!c.in_place) {
    std::shuffle(perm.begin(), perm.end(), rng);
    final_slot.assign(perm.begin(), perm.begin() + N);
  }

  Pool initial(rp, slots, initial_slot, c.layout, c.state_dtype);
  Pool separate_final(rp, slots, std::vector<int64_t>(N, -1), c.layout, c.state_dtype);  // all poison
  Pool& final_pool = c.in_place ? initial : separate_final;
  const std::vector<unsigned char> final_before = final_pool.bytes();
  const auto idx = index_bytes(initial_slot, c.index_dtype), fidx = index_bytes(final_slot, c.index_dtype);

  Problem p = base;
  std::vector<uint16_t> out(static_cast<size_t>(p.total_tokens * p.H * p.V), 0xABCD);  // poison
  p.out = out.data();
  p.state_layout = c.layout;
  p.state_indices = idx.data();
  p.state_indices_dtype = c.index_dtype;
  p.initial_state = c.has_initial ? initial.data() : nullptr;
  p.initial_slots = c.has_initial ? slots : 0;
  p.final_state = final_pool.data();
  p.final_slots = slots;
  if (!c.in_place) {
    p.final_state_indices = fidx.data();
    p.final_state_indices_dtype = c.index_dtype;
  }
  ASSERT_NO_THROW(testing::run_forward(testing::to_forward_args(p)));

  // The reference: the plain [N, H, V, K] problem.
  std::vector<double> ref_out(rp.out_size()), ref_state(rp.state_size());
  oracle_forward(base, ref_out.data(), ref_state.data());

  const std::vector<int64_t> offsets = host_sequence_offsets(base);
  std::vector<bool> written(static_cast<size_t>(slots), false);
  for (int64_t n = 0; n < N; ++n) {
    const bool pad = initial_slot[n] < 0;
    // The contract's measure on the sequence's rows of out (every token of it, all heads).
    const size_t row = static_cast<size_t>(offsets[n] * p.H * p.V);
    const size_t len = static_cast<size_t>((offsets[n + 1] - offsets[n]) * p.H * p.V);
    if (pad) {
      for (size_t i = 0; i < len; ++i) ASSERT_EQ(out[row + i], 0xABCD) << "padding sequence " << n << " wrote out";
      continue;
    }
    EXPECT_LE(rel_error(ref_out.data() + row, out.data() + row, len), kBar) << "out of sequence " << n;
    written[final_slot[n]] = true;
    std::vector<double> got(static_cast<size_t>(p.H * p.V * p.K));
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t v = 0; v < p.V; ++v)
        for (int64_t k = 0; k < p.K; ++k)
          got[static_cast<size_t>((h * p.V + v) * p.K + k)] =
              final_pool.at(p, final_slot[n], h, v, k, c.layout, c.state_dtype);
    const size_t base_n = static_cast<size_t>(n * p.H * p.V * p.K);
    EXPECT_LE(rel_error(ref_state.data() + base_n, got.data(), got.size()), kBar) << "final state of sequence " << n;
  }
  const size_t slot_bytes = final_pool.slot_bytes(c.state_dtype);
  for (int64_t s = 0; s < slots; ++s)
    if (!written[s])
      EXPECT_EQ(0, std::memcmp(final_pool.bytes().data() + s * slot_bytes, final_before.data() + s * slot_bytes,
                               slot_bytes))
          << "slot " << s << " was not addressed but changed";
}

TEST(StatePools, InPlaceShuffledSlotsBothLayoutsAndDtypes) {
  uint64_t seed = 1;
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV})
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (DType index : {DType::kI64, DType::kI32}) run_pool_case({layout, dtype, index, true, true, {}}, seed++);
}

TEST(StatePools, SeparateFinalSlotsAndPadding) {
  run_pool_case({StateLayout::kVK, DType::kF32, DType::kI64, false, true, {1, 3}}, 11);
  run_pool_case({StateLayout::kKV, DType::kBF16, DType::kI32, false, true, {0}}, 12);
  run_pool_case({StateLayout::kVK, DType::kBF16, DType::kI64, true, true, {4}}, 13);
}

TEST(StatePools, NoInitialStateWritesTheSlots) {
  run_pool_case({StateLayout::kVK, DType::kF32, DType::kI64, true, false, {2}}, 21);
  run_pool_case({StateLayout::kKV, DType::kF32, DType::kI32, true, false, {}}, 22);
}

// K-major states without a pool: [N, H, K, V].
TEST(StatePools, KMajorStatesWithoutIndices) {
  ProblemSpec spec;
  spec.H = 2;
  spec.seqlens = {20, 33};
  spec.init = InitState::kNormal;
  spec.seed = 31;
  RandomProblem rp(spec);
  const Problem& base = rp.problem();
  std::vector<int64_t> identity = {0, 1};
  Pool initial(rp, base.N, identity, StateLayout::kKV, DType::kF32);
  Pool final_pool(rp, base.N, {-1, -1}, StateLayout::kKV, DType::kF32);
  Problem p = base;
  std::vector<uint16_t> out(rp.out_size());
  p.out = out.data();
  p.state_layout = StateLayout::kKV;
  p.initial_state = initial.data();
  p.final_state = final_pool.data();
  ASSERT_NO_THROW(testing::run_forward(testing::to_forward_args(p)));
  std::vector<double> ref_out(rp.out_size()), ref_state(rp.state_size());
  oracle_forward(base, ref_out.data(), ref_state.data());
  EXPECT_LE(rel_error(ref_out.data(), out.data(), out.size()), kBar);
  std::vector<double> got(rp.state_size());
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t v = 0; v < p.V; ++v)
        for (int64_t k = 0; k < p.K; ++k)
          got[static_cast<size_t>(((n * p.H + h) * p.V + v) * p.K + k)] =
              final_pool.at(p, n, h, v, k, StateLayout::kKV, DType::kF32);
  EXPECT_LE(rel_error(ref_state.data(), got.data(), got.size()), kBar);
}

// ---------------------------------------------------------------------------------------------
// Speculative verify, with the Triton decode kernel's semantics: request n starts from slot
// idx[n, accepted[n] - 1] and the state after draft token t goes to slot idx[n, t].

TEST(StatePools, PerTokenStatesForSpeculativeVerify) {
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    SCOPED_TRACE(layout == StateLayout::kVK ? "VK" : "KV");
    ProblemSpec spec;
    spec.H = 2;
    spec.seqlens = {4, 3, 4, 1};  // draft tokens per request (packed)
    spec.init = InitState::kNormal;
    spec.seed = 51;
    RandomProblem rp(spec);
    const Problem& base = rp.problem();
    const int64_t N = base.N, T_max = 4, slots = N * T_max + 3;
    std::mt19937_64 rng(51);
    std::vector<int64_t> perm(static_cast<size_t>(slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> idx(perm.begin(), perm.begin() + N * T_max);  // [N, T_max], distinct slots
    const std::vector<int64_t> accepted = {2, 1, 4, 1};
    std::vector<int64_t> start(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) start[n] = idx[n * T_max + accepted[n] - 1];
    idx[1 * T_max + 3] = -1;  // request 1 has 3 tokens; its fourth column is unused
    start[3] = -1;           // request 3 is padding: skipped, nothing written

    // The pool holds each request's initial state at its start slot (the random problem's states).
    Pool pool(rp, slots, start, layout, DType::kF32);
    const std::vector<unsigned char> before = pool.bytes();
    Problem p = base;
    std::vector<uint16_t> out(rp.out_size(), 0xABCD);
    p.out = out.data();
    p.state_layout = layout;
    p.initial_state = p.final_state = pool.data();
    p.initial_slots = p.final_slots = slots;
    p.state_indices = start.data();
    p.token_state_indices = idx.data();
    p.token_state_columns = T_max;
    ASSERT_NO_THROW(testing::run_forward(testing::to_forward_args(p)));

    const std::vector<int64_t> offsets = host_sequence_offsets(base);
    std::vector<bool> written(static_cast<size_t>(slots), false);
    std::vector<double> ref_out(rp.out_size()), ref_state(rp.state_size());
    for (int64_t n = 0; n < N; ++n) {
      const int64_t len = offsets[n + 1] - offsets[n];
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = idx[n * T_max + t];
        if (start[n] < 0 || slot < 0) continue;
        written[slot] = true;
        // The oracle on request n's first t + 1 tokens (rows of the packed inputs; the oracle
        // reads the offsets as given): its final state is the one after token t.
        std::vector<int64_t> one = {offsets[n], offsets[n] + t + 1};
        Problem single = base;
        single.N = 1, single.cu_seqlens = one.data(), single.cu_seqlens_dtype = DType::kI64;
        single.B = 1, single.T = base.T;  // rows [offsets[n], offsets[n] + t + 1) of the packed inputs
        std::vector<double> out1(rp.out_size()), state1(static_cast<size_t>(p.H * p.V * p.K));
        const size_t state_bytes = sizeof(float) * static_cast<size_t>(p.H * p.V * p.K);
        single.initial_state = reinterpret_cast<const unsigned char*>(rp.init_f32.data()) + n * state_bytes;
        oracle_forward(single, out1.data(), state1.data());
        std::vector<double> got(state1.size());
        for (int64_t h = 0; h < p.H; ++h)
          for (int64_t v = 0; v < p.V; ++v)
            for (int64_t k = 0; k < p.K; ++k)
              got[static_cast<size_t>((h * p.V + v) * p.K + k)] = pool.at(p, slot, h, v, k, layout, DType::kF32);
        EXPECT_LE(rel_error(state1.data(), got.data(), got.size()), kBar) << "request " << n << ", token " << t;
        if (t == len - 1) {  // the outputs of the whole request, from the last prefix run
          const size_t row = static_cast<size_t>(offsets[n] * p.H * p.V), n_elems = static_cast<size_t>(len * p.H * p.V);
          EXPECT_LE(rel_error(out1.data() + row, out.data() + row, n_elems), kBar) << "out of request " << n;
        }
      }
      if (start[n] < 0)
        for (int64_t t = offsets[n] * p.H * p.V; t < offsets[n + 1] * p.H * p.V; ++t)
          ASSERT_EQ(out[t], 0xABCD) << "padding request wrote out";
    }
    const size_t slot_bytes = pool.slot_bytes(DType::kF32);
    for (int64_t s = 0; s < slots; ++s)
      if (!written[s])
        EXPECT_EQ(0, std::memcmp(pool.bytes().data() + s * slot_bytes, before.data() + s * slot_bytes, slot_bytes))
            << "slot " << s << " was not addressed but changed";
  }
}

// ---------------------------------------------------------------------------------------------
// Bad indices and pools are refused before anything is written.

class PoolRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    ProblemSpec spec;
    spec.H = 1;
    spec.seqlens = {5, 7, 3};
    spec.init = InitState::kNormal;
    spec.seed = 41;
    rp_ = std::make_unique<RandomProblem>(spec);
    pool_ = std::make_unique<Pool>(*rp_, 6, std::vector<int64_t>{4, 0, 2}, StateLayout::kVK, DType::kF32);
    p_ = rp_->problem();
    out_.assign(rp_->out_size(), 0xABCD);
    p_.out = out_.data();
    p_.initial_state = p_.final_state = pool_->data();
    p_.initial_slots = p_.final_slots = 6;
    p_.state_indices = idx_.data();
    p_.state_indices_dtype = DType::kI64;
  }
  // Refused with kInvalidArgument, a message with `what`, and nothing written.
  void expect_refused(const std::vector<std::string>& what) {
    const std::vector<unsigned char> before = pool_->bytes();
    const std::string message = testing::refusal_message(testing::to_forward_args(p_));
    for (const std::string& w : what) EXPECT_THAT(message, HasSubstr(w));
    EXPECT_TRUE(pool_->bytes() == before) << "the pool was written";
    for (uint16_t x : out_) ASSERT_EQ(x, 0xABCD) << "out was written";
  }

  std::unique_ptr<RandomProblem> rp_;
  std::unique_ptr<Pool> pool_;
  Problem p_;
  std::vector<uint16_t> out_;
  std::vector<int64_t> idx_ = {4, 0, 2}, fidx_ = {1, 3, 5};
};

TEST_F(PoolRefusals, ValidPoolRuns) { EXPECT_NO_THROW(testing::run_forward(testing::to_forward_args(p_))); }

TEST_F(PoolRefusals, IndexOutsideThePool) {
  idx_[1] = 6;
  expect_refused({"state_indices:", "state_indices[1] = 6", "pool of 6 slots"});
}

TEST_F(PoolRefusals, FinalIndexOutsideThePool) {
  fidx_[2] = 9;
  p_.final_state_indices = fidx_.data();
  p_.final_state_indices_dtype = DType::kI64;
  expect_refused({"final_state_indices:", "final_state_indices[2] = 9", "pool of 6 slots"});
}

TEST_F(PoolRefusals, TwoSequencesWriteOneSlot) {
  idx_ = {4, 0, 4};
  expect_refused({"state_indices:", "sequences 0 and 2 both write slot 4"});
}

TEST_F(PoolRefusals, WritingASlotAnotherSequenceReadsInTheSameBuffer) {
  fidx_ = {0, 1, 3};  // sequence 0 writes slot 0, which sequence 1 starts from
  p_.final_state_indices = fidx_.data();
  p_.final_state_indices_dtype = DType::kI64;
  expect_refused({"final_state_indices:", "sequence 0 writes slot 0", "sequence 1 starts from"});
}

TEST_F(PoolRefusals, FinalIndicesWithoutStateIndices) {
  p_.state_indices = nullptr;
  p_.initial_slots = p_.final_slots = 3;
  p_.initial_state = p_.final_state = nullptr;
  p_.final_state_indices = fidx_.data();
  p_.final_state_indices_dtype = DType::kI64;
  expect_refused({"final_state_indices:", "without state_indices"});
}

TEST_F(PoolRefusals, IndicesWithoutAPool) {
  p_.initial_state = p_.final_state = nullptr;
  p_.initial_slots = p_.final_slots = 0;
  expect_refused({"state_indices:", "no pool"});
}

TEST_F(PoolRefusals, PoolOfTheWrongHeadCount) {
  ForwardArgs a = testing::to_forward_args(p_);
  a.initial_state.shape[1] = 2;
  EXPECT_THAT(testing::refusal_message(a), HasSubstr("initial_state: expected shape [6, 1, 128, 128] [P, H, V, K]"));
}

TEST_F(PoolRefusals, IndicesOfTheWrongLength) {
  ForwardArgs a = testing::to_forward_args(p_);
  a.state_indices.shape[0] = 2;
  EXPECT_THAT(testing::refusal_message(a), HasSubstr("state_indices: expected shape [3] [N]"));
}

TEST_F(PoolRefusals, TokenStatesForMoreTokensThanColumns) {
  std::vector<int64_t> tokens = {0, 1, 2, 3, 5, 6};  // [3, 2]: sequences of 5, 7, 3 tokens need 7 columns
  p_.token_state_indices = tokens.data();
  p_.token_state_columns = 2;
  expect_refused({"token_state_indices:", "sequence 0 has 5 tokens, more than its 2 columns"});
}

TEST_F(PoolRefusals, TokenStatesWritingOneSlotTwice) {
  std::vector<int64_t> tokens(3 * 7, -1);
  tokens[0] = 1, tokens[1] = 1;  // sequence 0, tokens 0 and 1
  p_.token_state_indices = tokens.data();
  p_.token_state_columns = 7;
  expect_refused({"token_state_indices:", "sequence 0 writes slot 1 twice"});
}

TEST_F(PoolRefusals, TokenStateIntoASlotAnotherSequenceStartsFrom) {
  std::vector<int64_t> tokens(3 * 7, -1);
  tokens[7 + 2] = 4;  // sequence 1, token 2 -> slot 4, which sequence 0 starts from
  p_.token_state_indices = tokens.data();
  p_.token_state_columns = 7;
  expect_refused({"token_state_indices:", "sequence 1 writes slot 4", "sequence 0 starts from"});
}

TEST_F(PoolRefusals, TokenStatesWithoutAPool) {
  std::vector<int64_t> tokens(3 * 7, -1);
  p_.state_indices = nullptr;
  p_.initial_slots = p_.final_slots = 3;
  p_.initial_state = p_.final_state = nullptr;
  p_.token_state_indices = tokens.data();
  p_.token_state_columns = 7;
  expect_refused({"token_state_indices:", "final_state pool"});
}

TEST_F(PoolRefusals, UnknownLayout) {
  p_.state_layout = static_cast<StateLayout>(7);
  expect_refused({"state_layout:", "got 7"});
}

}  // namespace
}  // namespace flashkda
