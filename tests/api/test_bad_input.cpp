// Bad inputs that used to get through (issue 9): empty tensors taken as absent, outputs that
// partially overlap an input, shapes whose size overflows. Host tensors, CPU backend; each test
// also goes through the C ABI (EXPECT_REFUSED).
#include <cstring>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "expect_refused.h"
#include "host_args.h"

namespace flashkda::api_test {
namespace {

using ::testing::HasSubstr;

class BadInput : public HostArgsTest {};

// ---------------------------------------------------------------------------------------------
// A tensor that is passed is given, even with no elements (frameworks hand out a null pointer
// for those): its shape is checked like any other, never read as "absent".

TEST_F(BadInput, EmptyInitialStateIsCheckedNotIgnored) {
  a.initial_state = make_tensor(nullptr, DType::kBF16, 0, 2, 128, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"), HasSubstr("expected shape [2, 2, 128, 128]"),
                 HasSubstr("got [0, 2, 128, 128]"));
}

TEST_F(BadInput, EmptyFinalStateIsCheckedNotIgnored) {
  a.final_state = make_tensor(nullptr, DType::kBF16, 0, 2, 128, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state:"), HasSubstr("expected shape [2, 2, 128, 128]"),
                 HasSubstr("got [0, 2, 128, 128]"));
}

TEST_F(BadInput, EmptyCuSeqlensIsCheckedNotIgnored) {
  a.cu_seqlens = make_tensor(nullptr, DType::kI64, 0);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("at least 2 entries"), HasSubstr("got 0"));
}

TEST_F(BadInput, EmptyRequiredTensorWithDimensionsIsNotMissing) {
  a.A_log = make_tensor(nullptr, DType::kF32, 0);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("expected shape [2]"), HasSubstr("got [0]"));
}

// A problem with no tokens and empty tensors everywhere is valid, and keeps the states.
TEST(BadInputEmpty, NoTokensWithEmptyTensorsCopiesTheState) {
  HostSetup s;
  s.T = 0;
  s.cu_seqlens = {0, 0, 0};
  HostProblem p(s);
  ForwardArgs a = p.args();
  for (Tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.out}) t->data = nullptr;  // as torch passes them
  ASSERT_NO_THROW(forward(a, nullptr, 0));
  EXPECT_EQ(0, std::memcmp(p.final_state.data(), p.initial_state.data(), p.final_state.size()));
}

// ---------------------------------------------------------------------------------------------
// Sizes: every tensor's byte size must fit in 64 bits (the backends derive offsets from them).

TEST_F(BadInput, TokenCountOverflowingSizeRefused) {
  for (int shift : {55, 62}) {
    const int64_t T = int64_t{1} << shift;
    ForwardArgs b = a;
    b.cu_seqlens = Tensor{};
    for (Tensor* t : {&b.q, &b.k, &b.v, &b.g, &b.out}) t->shape[1] = T;
    b.beta.shape[1] = T;
    b.initial_state.shape[0] = b.final_state.shape[0] = 1;
    EXPECT_REFUSED(p, b, kInvalid, HasSubstr("q:"), HasSubstr("too large"), HasSubstr("overflows 64 bits"));
  }
}

TEST_F(BadInput, HeadCountOverflowingSizeRefused) {
  const int64_t H = int64_t{1} << 60;
  for (Tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out, &a.beta}) t->shape[2] = H;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("overflows 64 bits"));
}

TEST_F(BadInput, SequenceCountOverflowingSizeRefused) {
  a.cu_seqlens.shape[0] = int64_t{1} << 62;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("overflows 64 bits"));
}

// ---------------------------------------------------------------------------------------------
// Overlaps: an output may not partially overlap any input or the other output; the exact aliases
// out = q / k / g and final_state = initial_state are supported and give the separate result.

TEST_F(BadInput, OutPartiallyOverlappingKRefused) {
  a.out.data = p.k.data() + 256;  // k = buf[:, :T], out = buf[:, 1:] style: one head row later
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out: overlaps k"), HasSubstr("partially overlap"));
}

TEST_F(BadInput, OutPartiallyOverlappingInitialStateRefused) {
  a.out.data = p.initial_state.data() + 4096;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out: overlaps initial_state"));
}

TEST_F(BadInput, FinalStatePartiallyOverlappingInitialStateRefused) {
  a.final_state.data = p.initial_state.data() + 64;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state: overlaps initial_state"), HasSubstr("partially overlap"));
}

TEST_F(BadInput, OutputsOverlappingEachOtherRefused) {
  a.out.data = p.final_state.data() + 1024;  // inside the larger final_state
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state: overlaps out"));
}

TEST_F(BadInput, OutOverlappingCuSeqlensRefused) {
  a.cu_seqlens.data = p.out.data() + 64;  // offsets read from inside out
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out: overlaps cu_seqlens"));
}

TEST_F(BadInput, OutExactlyAliasingVRefused) {
  a.out.data = p.v.data();
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out: overlaps v"), HasSubstr("aliasing is not supported"));
}

TEST_F(BadInput, ExactAliasesGiveTheSeparateResult) {
  ASSERT_NO_THROW(forward(a, nullptr, 0));
  const std::vector<unsigned char> expected_out(p.out.data(), p.out.data() + p.out.size());
  const std::vector<unsigned char> expected_state(p.final_state.data(), p.final_state.data() + p.final_state.size());
  for (const char* input : {"q", "k", "g"}) {
    HostProblem fresh;
    ForwardArgs b = fresh.args();
    Tensor& in = input[0] == 'q' ? b.q : input[0] == 'k' ? b.k : b.g;
    b.out.data = in.data;               // out written over the input
    b.final_state.data = b.initial_state.data;  // the state updated in place
    ASSERT_NO_THROW(forward(b, nullptr, 0)) << "out = " << input;
    EXPECT_EQ(0, std::memcmp(in.data, expected_out.data(), expected_out.size())) << "out = " << input;
    EXPECT_EQ(0, std::memcmp(b.final_state.data, expected_state.data(), expected_state.size()))
        << "final_state = initial_state, out = " << input;
  }
}

// ---------------------------------------------------------------------------------------------
// State pools: index values are checked before anything runs (through the C ABI too).

TEST_F(BadInput, StateIndexOutsideThePoolRefused) {
  const int64_t idx[] = {0, 5};
  a.state_indices = make_tensor(idx, DType::kI64, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("state_indices: state_indices[1] = 5"),
                 HasSubstr("outside initial_state's pool of 2 slots"));
}

TEST_F(BadInput, StateIndicesOfAnotherDtypeRefused) {
  const float idx[] = {0, 1};
  a.state_indices = make_tensor(idx, DType::kF32, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("state_indices: expected dtype int64 or int32, got float32"));
}

TEST_F(BadInput, PoolsInPlaceThroughTheCAbi) {
  const int32_t idx[] = {1, 0};  // the two sequences swap slots, in place: each reads its own
  a.state_indices = make_tensor(idx, DType::kI32, 2);
  a.final_state = a.initial_state;
  const flashkda_forward_args c = to_c(a);
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_OK) << flashkda_last_error();
}

}  // namespace
}  // namespace flashkda::api_test
