// Every bad input of issue 2 item 3, one test each, on host tensors (the CPU backend, so no GPU
// is needed). Each asserts the error code and that the message names the argument, the
// expectation and the value given; each also checks that the C ABI reports the same code and
// message, and that nothing was written to the outputs.
#include <cmath>
#include <cstring>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "expect_refused.h"
#include "host_args.h"

namespace flashkda::api_test {
namespace {

using ::testing::HasSubstr;

class Validation : public HostArgsTest {};

// ---------------------------------------------------------------------------------------------
// The valid problem itself is accepted (so every refusal below is due to the one change made).

TEST_F(Validation, TheValidProblemRuns) {
  EXPECT_EQ(backend_for(a), Backend::kCpu);
  EXPECT_EQ(forward_workspace_size(a), 0u);
  EXPECT_NO_THROW(forward(a, nullptr, 0));
  EXPECT_FALSE(p.out.all_equal(0xAB));
}

// ---------------------------------------------------------------------------------------------
// Wrong dtype

TEST_F(Validation, QWrongDtype) {
  a.q.dtype = DType::kF32;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float32"));
}

TEST_F(Validation, KWrongDtype) {
  a.k.dtype = DType::kF16;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float16"));
}

TEST_F(Validation, VWrongDtype) {
  a.v.dtype = DType::kF32;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("v:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float32"));
}

TEST_F(Validation, GWrongDtype) {
  a.g.dtype = DType::kF32;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("g:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float32"));
}

TEST_F(Validation, BetaWrongDtype) {
  a.beta.dtype = DType::kF16;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("beta:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float16"));
}

TEST_F(Validation, ALogWrongDtype) {
  a.A_log.dtype = DType::kBF16;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("expected dtype float32"), HasSubstr("got bfloat16"));
}

TEST_F(Validation, DtBiasWrongDtype) {
  a.dt_bias.dtype = DType::kF64;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("dt_bias:"), HasSubstr("expected dtype float32"), HasSubstr("got float64"));
}

TEST_F(Validation, OutWrongDtype) {
  a.out.dtype = DType::kF32;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out:"), HasSubstr("expected dtype bfloat16"), HasSubstr("got float32"));
}

TEST_F(Validation, InitialStateWrongDtype) {
  a.initial_state.dtype = DType::kF16;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"), HasSubstr("expected dtype bfloat16 or float32"),
                 HasSubstr("got float16"));
}

TEST_F(Validation, FinalStateWrongDtype) {
  a.final_state.dtype = DType::kF64;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state:"), HasSubstr("expected dtype bfloat16 or float32"),
                 HasSubstr("got float64"));
}

TEST_F(Validation, CuSeqlensWrongDtype) {
  a.cu_seqlens.dtype = DType::kF32;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected dtype int64 or int32"),
                 HasSubstr("got float32"));
}

TEST_F(Validation, DtypeOutsideTheEnumThroughTheCAbi) {
  flashkda_forward_args c = to_c(a);
  c.q.dtype = 99;
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), ::testing::AllOf(HasSubstr("q:"), HasSubstr("expected dtype bfloat16"),
                                                      HasSubstr("unknown dtype")));
  EXPECT_TRUE(p.outputs_untouched());
}

// ---------------------------------------------------------------------------------------------
// Wrong number of dimensions

TEST_F(Validation, QWrongNdim) {
  a.q = make_tensor(a.q.data, DType::kBF16, 40, 2, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("expected 4 dimensions [B, T, H, K]"),
                 HasSubstr("got 3 dimensions with shape [40, 2, 128]"));
}

TEST_F(Validation, KWrongNdim) {
  a.k = make_tensor(a.k.data, DType::kBF16, 40, 2, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("expected 4 dimensions"),
                 HasSubstr("got 3 dimensions with shape [40, 2, 128]"));
}

TEST_F(Validation, VWrongNdim) {
  a.v = make_tensor(a.v.data, DType::kBF16, 80, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("v:"), HasSubstr("expected 4 dimensions [B, T, H, V]"),
                 HasSubstr("got 2 dimensions with shape [80, 128]"));
}

TEST_F(Validation, BetaWrongNdim) {
  a.beta = make_tensor(a.beta.data, DType::kBF16, 1, 40, 2, 1);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("beta:"), HasSubstr("expected 3 dimensions [B, T, H]"),
                 HasSubstr("got 4 dimensions with shape [1, 40, 2, 1]"));
}

TEST_F(Validation, ALogWrongNdim) {
  a.A_log = make_tensor(a.A_log.data, DType::kF32, 1, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("expected 1 dimension [H]"),
                 HasSubstr("got 2 dimensions with shape [1, 2]"));
}

TEST_F(Validation, DtBiasWrongNdim) {
  a.dt_bias = make_tensor(a.dt_bias.data, DType::kF32, 256);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("dt_bias:"), HasSubstr("expected 2 dimensions [H, K]"),
                 HasSubstr("got 1 dimension with shape [256]"));
}

TEST_F(Validation, OutWrongNdim) {
  a.out = make_tensor(a.out.data, DType::kBF16, 40, 2, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out:"), HasSubstr("expected 4 dimensions [B, T, H, V]"),
                 HasSubstr("got 3 dimensions with shape [40, 2, 128]"));
}

TEST_F(Validation, StateWrongNdim) {
  a.initial_state = make_tensor(a.initial_state.data, DType::kBF16, 4, 128, 128);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"), HasSubstr("expected 4 dimensions [N, H, V, K]"),
                 HasSubstr("got 3 dimensions with shape [4, 128, 128]"));
}

TEST_F(Validation, CuSeqlensWrongNdim) {
  a.cu_seqlens = make_tensor(a.cu_seqlens.data, DType::kI64, 1, 3);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected 1 dimension [N + 1]"),
                 HasSubstr("got 2 dimensions with shape [1, 3]"));
}

TEST_F(Validation, NegativeDimension) {
  a.q.shape[1] = -40;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("dimension 1 is negative"),
                 HasSubstr("[1, -40, 2, 128]"));
}

// ---------------------------------------------------------------------------------------------
// Inconsistent shapes

TEST_F(Validation, KShapeDiffersFromQ) {
  a.k.shape[2] = 3;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("expected shape [1, 40, 2, 128]"),
                 HasSubstr("same as q"), HasSubstr("got [1, 40, 3, 128]"));
}

TEST_F(Validation, VShapeDiffersFromQ) {
  a.v.shape[1] = 39;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("v:"), HasSubstr("expected shape [1, 40, 2, V]"),
                 HasSubstr("matching q's [B, T, H]"), HasSubstr("got [1, 39, 2, 128]"));
}

TEST_F(Validation, GShapeDiffersFromQ) {
  a.g.shape[3] = 64;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("g:"), HasSubstr("expected shape [1, 40, 2, 128]"),
                 HasSubstr("got [1, 40, 2, 64]"));
}

TEST_F(Validation, BetaShapeDiffersFromQ) {
  a.beta.shape[2] = 4;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("beta:"), HasSubstr("expected shape [1, 40, 2] [B, T, H]"),
                 HasSubstr("got [1, 40, 4]"));
}

TEST_F(Validation, ALogShapeDiffersFromHeads) {
  a.A_log.shape[0] = 3;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("expected shape [2] [H]"), HasSubstr("got [3]"));
}

TEST_F(Validation, DtBiasShapeDiffers) {
  a.dt_bias.shape[1] = 64;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("dt_bias:"), HasSubstr("expected shape [2, 128] [H, K]"),
                 HasSubstr("got [2, 64]"));
}

TEST_F(Validation, OutShapeDiffers) {
  a.out.shape[1] = 41;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out:"), HasSubstr("expected shape [1, 40, 2, 128] [B, T, H, V]"),
                 HasSubstr("got [1, 41, 2, 128]"));
}

TEST_F(Validation, InitialStateShapeDiffersFromSequenceCount) {
  a.initial_state.shape[0] = 3;  // cu_seqlens holds 2 sequences
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"),
                 HasSubstr("expected shape [2, 2, 128, 128] [N, H, V, K]"), HasSubstr("got [3, 2, 128, 128]"));
}

TEST_F(Validation, FinalStateShapeDiffers) {
  a.final_state.shape[1] = 1;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state:"),
                 HasSubstr("expected shape [2, 2, 128, 128] [N, H, V, K]"), HasSubstr("got [2, 1, 128, 128]"));
}

TEST_F(Validation, StateWithoutCuSeqlensHasOneEntryPerBatchRow) {
  a.cu_seqlens = Tensor{};  // now N = B = 1, but the states hold 2 sequences
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"), HasSubstr("expected shape [1, 2, 128, 128]"),
                 HasSubstr("got [2, 2, 128, 128]"));
}

// ---------------------------------------------------------------------------------------------
// Null data pointers where data is needed

TEST_F(Validation, QMissing) {
  a.q = Tensor{};
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("required tensor is missing"));
}

TEST_F(Validation, QNull) {
  a.q.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("data pointer is null"),
                 HasSubstr("shape [1, 40, 2, 128]"));
}

TEST_F(Validation, KNull) {
  a.k.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("data pointer is null"), HasSubstr("[1, 40, 2, 128]"));
}

TEST_F(Validation, KMissing) {
  a.k = Tensor{};  // not even a shape
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("required tensor is missing"));
}

TEST_F(Validation, VNull) {
  a.v.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("v:"), HasSubstr("data pointer is null"), HasSubstr("[1, 40, 2, 128]"));
}

TEST_F(Validation, GNull) {
  a.g.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("g:"), HasSubstr("data pointer is null"), HasSubstr("[1, 40, 2, 128]"));
}

TEST_F(Validation, BetaNull) {
  a.beta.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("beta:"), HasSubstr("data pointer is null"), HasSubstr("[1, 40, 2]"));
}

TEST_F(Validation, ALogNull) {
  a.A_log.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("data pointer is null"), HasSubstr("[2]"));
}

TEST_F(Validation, DtBiasNull) {
  a.dt_bias.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("dt_bias:"), HasSubstr("data pointer is null"), HasSubstr("[2, 128]"));
}

TEST_F(Validation, OutNull) {
  a.out.data = nullptr;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out:"), HasSubstr("data pointer is null"), HasSubstr("[1, 40, 2, 128]"));
}

// ---------------------------------------------------------------------------------------------
// Misaligned pointers (activations and states: 16 bytes; beta: 2; A_log, dt_bias: 4;
// cu_seqlens: its element size)

void* moved(void* ptr, int bytes) { return static_cast<unsigned char*>(ptr) + bytes; }

TEST_F(Validation, QMisaligned) {
  a.q.data = moved(a.q.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("q:"), HasSubstr("must be 16-byte aligned"), HasSubstr("got address 0x"),
                 HasSubstr("(offset 2)"));
}

TEST_F(Validation, KMisaligned) {
  a.k.data = moved(a.k.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("k:"), HasSubstr("must be 16-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, VMisaligned) {
  a.v.data = moved(a.v.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("v:"), HasSubstr("must be 16-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, GMisaligned) {
  a.g.data = moved(a.g.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("g:"), HasSubstr("must be 16-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, BetaMisaligned) {
  a.beta.data = moved(a.beta.data, 1);  // bf16 needs 2-byte alignment only
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("beta:"), HasSubstr("must be 2-byte aligned"), HasSubstr("(offset 1)"));
}

TEST_F(Validation, ALogMisaligned) {
  a.A_log.data = moved(a.A_log.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("A_log:"), HasSubstr("must be 4-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, DtBiasMisaligned) {
  a.dt_bias.data = moved(a.dt_bias.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("dt_bias:"), HasSubstr("must be 4-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, OutMisaligned) {
  a.out.data = moved(a.out.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("out:"), HasSubstr("must be 16-byte aligned"), HasSubstr("(offset 2)"));
}

TEST_F(Validation, InitialStateMisaligned) {
  a.initial_state.data = moved(a.initial_state.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("initial_state:"), HasSubstr("must be 16-byte aligned"),
                 HasSubstr("(offset 2)"));
}

TEST_F(Validation, FinalStateMisaligned) {
  a.final_state.data = moved(a.final_state.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("final_state:"), HasSubstr("must be 16-byte aligned"),
                 HasSubstr("(offset 2)"));
}

TEST_F(Validation, CuSeqlensMisaligned) {
  a.cu_seqlens.data = moved(a.cu_seqlens.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("must be 8-byte aligned"),
                 HasSubstr("(offset 2)"));
}

TEST(ValidationInt32, CuSeqlensMisaligned) {
  HostSetup s;
  s.cu_seqlens_dtype = DType::kI32;
  HostProblem p(s);
  ForwardArgs a = p.args();
  a.cu_seqlens.data = moved(a.cu_seqlens.data, 2);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("must be 4-byte aligned"),
                 HasSubstr("(offset 2)"));
}

// ---------------------------------------------------------------------------------------------
// cu_seqlens values and layout

HostProblem with_offsets(std::vector<int64_t> offsets, DType dtype = DType::kI64) {
  HostSetup s;
  s.cu_seqlens = std::move(offsets);
  s.cu_seqlens_dtype = dtype;
  return HostProblem(s);
}

TEST(ValidationCuSeqlens, NotStartingAtZero) {
  HostProblem p = with_offsets({1, 17, 40});
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected cu_seqlens[0] = 0"),
                 HasSubstr("got 1"));
}

TEST(ValidationCuSeqlens, Decreasing) {
  HostProblem p = with_offsets({0, 30, 17, 40});
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected non-decreasing values"),
                 HasSubstr("cu_seqlens[1] = 30 > cu_seqlens[2] = 17"));
}

TEST(ValidationCuSeqlens, DecreasingInt32) {
  HostProblem p = with_offsets({0, 30, 17, 40}, DType::kI32);
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected non-decreasing values"),
                 HasSubstr("cu_seqlens[1] = 30 > cu_seqlens[2] = 17"));
}

TEST(ValidationCuSeqlens, NegativeEntry) {
  HostProblem p = with_offsets({0, -5, 40});
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected non-decreasing values"),
                 HasSubstr("cu_seqlens[0] = 0 > cu_seqlens[1] = -5"));
}

TEST(ValidationCuSeqlens, EndingBeforeT) {
  HostProblem p = with_offsets({0, 17, 39});
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"),
                 HasSubstr("expected the last entry cu_seqlens[2] to equal the number of tokens T = 40"),
                 HasSubstr("got 39"));
}

TEST(ValidationCuSeqlens, EndingAfterT) {
  HostProblem p = with_offsets({0, 17, 41}, DType::kI32);
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("to equal the number of tokens T = 40"),
                 HasSubstr("got 41"));
}

TEST(ValidationCuSeqlens, TooShort) {
  HostSetup s;
  s.initial_state = s.final_state = false;
  HostProblem p(s);
  ForwardArgs a = p.args();
  a.cu_seqlens.shape[0] = 1;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("expected at least 2 entries [N + 1]"),
                 HasSubstr("got 1"));
}

TEST(ValidationCuSeqlens, BatchLargerThanOne) {
  HostSetup s;
  s.B = 2;
  s.T = 20;
  s.cu_seqlens = {};
  HostProblem p(s);  // a valid [2, 20] batch ...
  ForwardArgs a = p.args();
  const int64_t offsets[3] = {0, 17, 40};
  a.cu_seqlens = make_tensor(offsets, DType::kI64, 3);  // ... given cu_seqlens as well
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("cu_seqlens:"), HasSubstr("batch size B = 1"), HasSubstr("got B = 2"));
}

TEST(ValidationCuSeqlens, EmptySequencesAreAccepted) {
  HostProblem p = with_offsets({0, 0, 40, 40});
  EXPECT_NO_THROW(forward(p.args(), nullptr, 0));
}

// ---------------------------------------------------------------------------------------------
// State dtypes must match

TEST(ValidationStates, Bf16InF32OutRefused) {
  HostSetup s;
  s.initial_state_dtype = DType::kBF16;
  s.final_state_dtype = DType::kF32;
  HostProblem p(s);
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("final_state:"), HasSubstr("dtype float32"),
                 HasSubstr("differs from initial_state's bfloat16"), HasSubstr("same dtype"));
}

TEST(ValidationStates, F32InBf16OutRefused) {
  HostSetup s;
  s.initial_state_dtype = DType::kF32;
  s.final_state_dtype = DType::kBF16;
  HostProblem p(s);
  EXPECT_REFUSED(p, p.args(), kInvalid, HasSubstr("final_state:"), HasSubstr("dtype bfloat16"),
                 HasSubstr("differs from initial_state's float32"));
}

TEST(ValidationStates, FinalStateWithoutInitialStateMayBeEitherDtype) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    HostSetup s;
    s.initial_state = false;
    s.final_state_dtype = dtype;
    HostProblem p(s);
    EXPECT_NO_THROW(forward(p.args(), nullptr, 0)) << dtype_name(dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// lower_bound of the safe gate: [-5, 0)

TEST_F(Validation, LowerBoundBelowMinusFive) {
  a.lower_bound = -5.5f;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("lower_bound:"), HasSubstr("expected a value in [-5, 0)"),
                 HasSubstr("got -5.5"));
}

TEST_F(Validation, LowerBoundZero) {
  a.lower_bound = 0.0f;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("lower_bound:"), HasSubstr("expected a value in [-5, 0)"),
                 HasSubstr("got 0"));
}

TEST_F(Validation, LowerBoundPositive) {
  a.lower_bound = 1.0f;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("lower_bound:"), HasSubstr("expected a value in [-5, 0)"),
                 HasSubstr("got 1"));
}

TEST_F(Validation, LowerBoundNaN) {
  a.lower_bound = std::numeric_limits<float>::quiet_NaN();
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("lower_bound:"), HasSubstr("expected a value in [-5, 0)"),
                 HasSubstr("got nan"));
}

TEST_F(Validation, LowerBoundEdgesAccepted) {
  a.lower_bound = -5.0f;
  EXPECT_NO_THROW(forward(a, nullptr, 0));
  a.lower_bound = -1e-6f;
  EXPECT_NO_THROW(forward(a, nullptr, 0));
}

TEST_F(Validation, SoftplusGateIgnoresLowerBound) {
  a.gate = Gate::kSoftplus;
  a.lower_bound = 0.0f;
  EXPECT_NO_THROW(forward(a, nullptr, 0));
}

TEST_F(Validation, GateOutsideTheEnum) {
  a.gate = static_cast<Gate>(7);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("gate:"), HasSubstr("expected safe (0) or softplus (1)"), HasSubstr("got 7"));
}

TEST_F(Validation, SeqlenCheckOutsideTheEnum) {
  a.seqlen_check = static_cast<SeqlenCheck>(5);
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("seqlen_check:"), HasSubstr("expected kHost (0) or kDeviceGuardsOnly (1)"),
                 HasSubstr("got 5"));
}

// ---------------------------------------------------------------------------------------------
// Head sizes other than 128: valid by the contract, not implemented yet

TEST(ValidationHeadDim, K64Unsupported) {
  HostSetup s;
  s.K = 64;
  HostProblem p(s);
  EXPECT_REFUSED(p, p.args(), ErrorCode::kUnsupported, HasSubstr("q:"), HasSubstr("head dimension K must be 128"),
                 HasSubstr("not supported yet"), HasSubstr("got K = 64"));
}

TEST(ValidationHeadDim, V64Unsupported) {
  HostSetup s;
  s.V = 64;
  HostProblem p(s);
  EXPECT_REFUSED(p, p.args(), ErrorCode::kUnsupported, HasSubstr("v:"), HasSubstr("head dimension V must be 128"),
                 HasSubstr("not supported yet"), HasSubstr("got V = 64"));
}

// ---------------------------------------------------------------------------------------------
// scale

TEST_F(Validation, ScaleNaN) {
  a.scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("scale:"), HasSubstr("expected a finite number"), HasSubstr("got nan"));
}

TEST_F(Validation, ScaleInf) {
  a.scale = std::numeric_limits<float>::infinity();
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("scale:"), HasSubstr("expected a finite number"), HasSubstr("got inf"));
}

TEST_F(Validation, ScaleMinusInf) {
  a.scale = -std::numeric_limits<float>::infinity();
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("scale:"), HasSubstr("expected a finite number"), HasSubstr("got -inf"));
}

// flashkda.h says scale "must be finite and > 0" and ForwardArgs defaults it to 0, but
// validate_forward() only checks that it is finite: a caller who forgets to set it gets an
// all-zero output silently. Enable once the API decides (reported to the lead).
TEST_F(Validation, ScaleZeroRefused) {
  a.scale = 0.0f;
  EXPECT_REFUSED(p, a, kInvalid, HasSubstr("scale:"), HasSubstr("got 0"));
}

// ---------------------------------------------------------------------------------------------
// A valid call after refused ones works, and gives the same result as before

TEST_F(Validation, ValidCallAfterRefusedOnesWorks) {
  forward(a, nullptr, 0);
  const std::vector<unsigned char> expected_out(p.out.data(), p.out.data() + p.out.size());
  const std::vector<unsigned char> expected_state(p.final_state.data(), p.final_state.data() + p.final_state.size());

  ForwardArgs bad = a;
  bad.q.dtype = DType::kF32;
  EXPECT_THROW(forward(bad, nullptr, 0), Error);
  bad = a;
  bad.lower_bound = 1.0f;
  EXPECT_THROW(forward(bad, nullptr, 0), Error);
  HostProblem decreasing = with_offsets({0, 30, 17, 40});
  EXPECT_THROW(forward(decreasing.args(), nullptr, 0), Error);

  p.poison_outputs();
  ASSERT_NO_THROW(forward(a, nullptr, 0));
  EXPECT_EQ(0, std::memcmp(p.out.data(), expected_out.data(), expected_out.size()));
  EXPECT_EQ(0, std::memcmp(p.final_state.data(), expected_state.data(), expected_state.size()));
}

TEST_F(Validation, WorkspaceQueryValidatesToo) {
  ForwardArgs bad = a;
  bad.v.dtype = DType::kF32;
  try {
    forward_workspace_size(bad);
    ADD_FAILURE() << "forward_workspace_size accepted a float32 v";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), kInvalid);
    EXPECT_THAT(e.what(), ::testing::AllOf(HasSubstr("v:"), HasSubstr("expected dtype bfloat16"), HasSubstr("float32")));
  }
}

}  // namespace
}  // namespace flashkda::api_test
