// A device copy of a host RandomProblem for the GPU tests: inputs copied, outputs allocated with
// guard bytes behind them, poisoning and checks of the "every element written, nothing past
// the end" kind.
#pragma once

#include <cstdint>
#include <vector>

#include "common/random_problem.h"
#include "flashkda/flashkda.h"

namespace flashkda::testing {

class DeviceProblem {
 public:
  explicit DeviceProblem(const RandomProblem& host);
  ~DeviceProblem();
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  const Problem& problem() const { return p_; }
  ForwardArgs args() const { return to_forward_args(p_); }

  // Fills out and final_state with 0xFF bytes (bf16/f32 NaN) and their guard areas with a pattern.
  void poison_outputs();
  // Runs forward on `stream` with a workspace of exactly the queried size, then synchronises.
  void run(cudaStream_t stream = nullptr);
  bool guards_intact() const;
  std::vector<uint16_t> out() const;          // [B*T, H, V] bf16 bits
  std::vector<uint8_t> final_state() const;   // raw bytes, empty when not requested

  // What one call wrote, for comparing calls bit for bit.
  struct Outputs {
    std::vector<uint16_t> out;
    std::vector<uint8_t> final_state;
  };
  // poison_outputs(), run(stream), then what the call wrote.
  Outputs run_fresh(cudaStream_t stream = nullptr);

 private:
  void* upload(const void* host, size_t bytes);
  void* alloc_guarded(size_t bytes);

  Problem p_;
  size_t out_bytes_ = 0, final_bytes_ = 0;
  std::vector<void*> allocations_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// Throws (via GoogleTest failure) on a CUDA error.
void check_cuda(int err, const char* what);

}  // namespace flashkda::testing
