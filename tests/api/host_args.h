// Host tensors for the API tests: a small valid forward problem whose arguments a test can then
// break one at a time, and a helper that runs forward() on them through the C++ API and the
// C ABI and reports how it refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"
#include "flashkda/flashkda_c.h"

namespace flashkda::api_test {

// A byte buffer whose data() is 64-byte aligned, with slack after the end so that a pointer
// moved by a few bytes still lies inside the allocation.
class AlignedBytes {
 public:
  explicit AlignedBytes(size_t bytes = 0);
  AlignedBytes(AlignedBytes&&) = default;  // moving keeps the storage, so the offset stays valid
  AlignedBytes& operator=(AlignedBytes&&) = default;
  AlignedBytes(const AlignedBytes&) = delete;
  AlignedBytes& operator=(const AlignedBytes&) = delete;
  unsigned char* data();
  const unsigned char* data() const;
  size_t size() const { return size_; }
  void fill(unsigned char byte);          // the whole allocation, slack included
  bool all_equal(unsigned char byte) const;

 private:
  std::vector<unsigned char> storage_;
  size_t size_ = 0;
  size_t offset_ = 0;
};

struct HostSetup {
  int64_t B = 1, T = 40, H = 2, K = 128, V = 128;
  std::vector<int64_t> cu_seqlens = {0, 17, 40};  // empty: no cu_seqlens (N = B)
  DType cu_seqlens_dtype = DType::kI64;
  bool initial_state = true;
  DType initial_state_dtype = DType::kBF16;
  bool final_state = true;
  DType final_state_dtype = DType::kBF16;
};

// Owns valid inputs and outputs for a HostSetup; args() points at them.
class HostProblem {
 public:
  explicit HostProblem(const HostSetup& setup = {});
  int64_t N() const;
  ForwardArgs args();
  void poison_outputs();          // out and final_state (with their slack) := 0xAB
  bool outputs_untouched() const; // still all 0xAB

  HostSetup setup;
  AlignedBytes q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, cu_seqlens, out;
};

// How forward() answered arguments it should refuse.
struct Refusal {
  bool thrown = false;           // the C++ API threw flashkda::Error
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  bool outputs_untouched = true; // nothing was written to out / final_state
  int c_code = 0;                // flashkda_forward() through the C ABI
  std::string c_message;         // flashkda_last_error() after it
};

// Runs forward(args) on host tensors through the C++ API, then through the C ABI.
Refusal refuse(HostProblem& problem, const ForwardArgs& args);

flashkda_tensor to_c(const Tensor& t);
flashkda_forward_args to_c(const ForwardArgs& a);

}  // namespace flashkda::api_test
