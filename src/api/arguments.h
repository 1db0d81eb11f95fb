// One description per tensor argument of forward(), shared by every layer that handles the
// arguments one by one: the validation (required, dtypes, outputs), the overlap and location
// checks, the C ABI's conversion and the Python binding (names, order, expected dtypes,
// writability). Adding an argument is one row here plus its field in ForwardArgs and
// flashkda_forward_args; the shape relations between arguments stay in validate.cpp.
#pragma once

#include <cstddef>

#include "flashkda/flashkda.h"
#include "flashkda/flashkda_c.h"

namespace flashkda {

struct TensorArgument {
  const char* name;
  Tensor ForwardArgs::*member;
  flashkda_tensor flashkda_forward_args::*c_member;
  bool required;
  bool output;             // written by forward()
  DType dtypes[2];         // accepted dtypes (num_dtypes of them)
  int num_dtypes;
  const char* dtype_words; // the dtypes as the error messages word them
  const char* shape;       // as the docs write it
  bool strided = false;    // may be a strided view (last dimension contiguous)
};

// In the order the Python binding passes them (its ARG_NAMES).
inline constexpr TensorArgument kTensorArguments[] = {
    {"q", &ForwardArgs::q, &flashkda_forward_args::q, true, false, {DType::kBF16}, 1, "bfloat16", "[B, T, H, K]", true},
    {"k", &ForwardArgs::k, &flashkda_forward_args::k, true, false, {DType::kBF16}, 1, "bfloat16", "[B, T, H, K]", true},
    {"v", &ForwardArgs::v, &flashkda_forward_args::v, true, false, {DType::kBF16}, 1, "bfloat16", "[B, T, H, V]", true},
    {"g", &ForwardArgs::g, &flashkda_forward_args::g, true, false, {DType::kBF16}, 1, "bfloat16", "[B, T, H, K]", true},
    {"beta", &ForwardArgs::beta, &flashkda_forward_args::beta, true, false, {DType::kBF16}, 1, "bfloat16",
     "[B, T, H]", true},
    {"A_log", &ForwardArgs::A_log, &flashkda_forward_args::A_log, true, false, {DType::kF32}, 1, "float32", "[H]"},
    {"dt_bias", &ForwardArgs::dt_bias, &flashkda_forward_args::dt_bias, true, false, {DType::kF32}, 1, "float32",
     "[H, K]"},
    {"out", &ForwardArgs::out, &flashkda_forward_args::out, true, true, {DType::kBF16}, 1, "bfloat16",
     "[B, T, H, V]"},
    {"initial_state", &ForwardArgs::initial_state, &flashkda_forward_args::initial_state, false, false,
     {DType::kBF16, DType::kF32}, 2, "bfloat16 or float32", "[N, H, V, K]"},
    {"final_state", &ForwardArgs::final_state, &flashkda_forward_args::final_state, false, true,
     {DType::kBF16, DType::kF32}, 2, "bfloat16 or float32", "[N, H, V, K]"},
    {"cu_seqlens", &ForwardArgs::cu_seqlens, &flashkda_forward_args::cu_seqlens, false, false,
     {DType::kI64, DType::kI32}, 2, "int64 or int32", "[N + 1]"},
    {"state_indices", &ForwardArgs::state_indices, &flashkda_forward_args::state_indices, false, false,
     {DType::kI64, DType::kI32}, 2, "int64 or int32", "[N]"},
    {"final_state_indices", &ForwardArgs::final_state_indices, &flashkda_forward_args::final_state_indices, false,
     false, {DType::kI64, DType::kI32}, 2, "int64 or int32", "[N]"},
    {"checkpoint_offsets", &ForwardArgs::checkpoint_offsets, &flashkda_forward_args::checkpoint_offsets, false,
     false, {DType::kI64, DType::kI32}, 2, "int64 or int32", "[N, C]"},
    {"checkpoint_state", &ForwardArgs::checkpoint_state, &flashkda_forward_args::checkpoint_state, false, true,
     {DType::kF32}, 1, "float32", "[N, C, H, V, K]"},
    {"token_state_indices", &ForwardArgs::token_state_indices, &flashkda_forward_args::token_state_indices, false,
     false, {DType::kI64, DType::kI32}, 2, "int64 or int32", "[N, T_max]"},
};
inline constexpr int kNumTensorArguments = static_cast<int>(std::size(kTensorArguments));

}  // namespace flashkda
