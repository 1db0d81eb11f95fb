// The accuracy check of the tool: a slice of heads (of every sequence) run through the fp64
// oracle and compared with a backend's output, rel = ||x - ref|| / ||ref|| (docs/contract.md).
#pragma once

#include <cstdint>
#include <vector>

#include "workload.h"

namespace flashkda::cli {

constexpr double kErrorBar = 3e-3;  // the bar of docs/contract.md on out and final_state

struct OracleCheck {
  std::vector<int64_t> heads;     // the heads checked (empty: check skipped)
  double out_rel = 0.0;           // NaN when the output holds NaN/Inf
  double final_state_rel = 0.0;   // meaningful when has_final_state (checkpoints included)
  bool has_final_state = false;
  std::vector<int64_t> checkpoint_columns;  // the checkpoints c checked (empty: none)
  double checkpoint_rel = 0.0;              // those checkpoints alone
  double seconds = 0.0;           // oracle time
  bool pass() const;              // both errors <= kErrorBar (NaN never passes)
};

// `count` heads spread over [0, H): 0, H-1, then evenly between.
std::vector<int64_t> pick_heads(int64_t H, int64_t count);

// out: the backend's [B*T, H, V] bf16 output on the host; final_state: its [N, H, V, K] state
// (dtype of the workload's state) on the host, or nullptr. Runs the oracle on `heads`. With a
// pool: the call on the first index set from the pool as generated; final_state holds the states
// it wrote, [N, W, H, V, K] (W = 1, or T with token states: the state after token t is checked
// against the oracle's final state on the first t + 1 tokens, all T of them in final_state_rel).
// checkpoint_state: the backend's fp32 [N, C, H, V, K] checkpoints, or nullptr; a middle one and
// the last are checked, each against the oracle's final state on that prefix of every sequence.
OracleCheck check_against_oracle(const HostInputs& in, const uint16_t* out, const void* final_state,
                                 const std::vector<int64_t>& heads, const float* checkpoint_state = nullptr);

// Elements still holding the 0xFF poison pattern (NaN) written before the timed runs.
int64_t count_poisoned(const void* data, size_t bytes, DType dtype);

}  // namespace flashkda::cli
