// The validated forward problem that every backend (oracle, CPU, CUDA) consumes.
// Built by validate_forward() from the public ForwardArgs; all pointers are typed views.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkda/flashkda.h"

namespace flashkda {

struct Problem {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0;
  int64_t N = 0;             // number of sequences (B, or cu_seqlens length - 1)
  int64_t total_tokens = 0;  // B * T: rows of the packed [B*T, H, *] activations
  const uint16_t* q = nullptr;     // [B*T, H, K] bf16 bits
  const uint16_t* k = nullptr;     // [B*T, H, K]
  const uint16_t* v = nullptr;     // [B*T, H, V]
  const uint16_t* g = nullptr;     // [B*T, H, K]
  const uint16_t* beta = nullptr;  // [B*T, H]
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H, K]
  const void* initial_state = nullptr;  // [N, H, V, K], optional
  DType initial_state_dtype = DType::kF32;
  void* final_state = nullptr;          // [N, H, V, K], optional
  DType final_state_dtype = DType::kF32;
  const void* cu_seqlens = nullptr;     // [N + 1], optional; absent: sequence n = rows [n*T, (n+1)*T)
  DType cu_seqlens_dtype = DType::kI64;
  uint16_t* out = nullptr;         // [B*T, H, V] bf16 bits
  float lower_bound = -5.0f;
  float scale = 1.0f;
  Gate gate = Gate::kSafe;
};

// Token offsets of the N sequences, N + 1 entries, for a problem whose cu_seqlens (if any) is
// readable from the host.
std::vector<int64_t> host_sequence_offsets(const Problem& p);

}  // namespace flashkda
