// The validated forward problem that every backend (oracle, CPU, CUDA) consumes.
// Built by validate_forward() from the public ForwardArgs; all pointers are typed views.
#pragma once

#include <cstdint>
#include <vector>

#include "flashkda/flashkda.h"

namespace flashkda {

// Where the rows of a [B, T, H, D] activation (or [B, T, H] for beta: D = 1) start: dense
// tensors are [B*T, H, D] row-major; a strided view (a slice of a fused projection) has its own
// batch, token and head strides, in elements, its last dimension contiguous.
struct RowStrides {
  bool dense = true;
  int64_t batch = 0, token = 0, head = 0;
};

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
  // States: [slots, H, V, K] (or [slots, H, K, V], state_layout); slots = N without indices.
  StateLayout state_layout = StateLayout::kVK;
  const void* state_indices = nullptr;        // [N], optional: the states are pools
  DType state_indices_dtype = DType::kI64;
  const void* final_state_indices = nullptr;  // [N], optional
  DType final_state_indices_dtype = DType::kI64;
  int64_t initial_slots = 0, final_slots = 0;  // slots of initial_state / final_state (0 when absent)
  const void* checkpoint_offsets = nullptr;   // [N, C], optional
  DType checkpoint_offsets_dtype = DType::kI64;
  float* checkpoint_state = nullptr;          // [N, C, H, V, K] (state layout), with checkpoint_offsets
  int64_t checkpoints = 0;                    // C
  const void* token_state_indices = nullptr;  // [N, T_max], optional (with state_indices)
  DType token_state_indices_dtype = DType::kI64;
  int64_t token_state_columns = 0;            // T_max
  uint16_t* out = nullptr;         // [B*T, H, V] bf16 bits
  RowStrides q_rows, k_rows, v_rows, g_rows, beta_rows;  // of q, k, v, g, beta (out is dense)

  // The element offset of row `row` (0 .. B*T - 1) of head h in an activation of row length `d`.
  int64_t row_offset(const RowStrides& s, int64_t row, int64_t h, int64_t d) const {
    if (s.dense) return (row * H + h) * d;
    return (T > 0 ? (row / T) * s.batch + (row % T) * s.token : 0) + h * s.head;
  }
  float lower_bound = -5.0f;
  float scale = 1.0f;
  Gate gate = Gate::kSafe;
};

// Element i of a host-readable int32 or int64 index array (cu_seqlens, state indices, offsets).
int64_t host_index(const void* indices, DType dtype, int64_t i);

// Token offsets of the N sequences, N + 1 entries, for a problem whose cu_seqlens (if any) is
// readable from the host.
std::vector<int64_t> host_sequence_offsets(const Problem& p);

// checkpoint_offsets[n, c] of a problem whose offsets are readable from the host.
int64_t host_checkpoint_offset(const Problem& p, int64_t n, int64_t c);

// Where each sequence's states live, for a problem whose state indices (if any) are readable from
// the host (common/state_slots.cpp): every backend reads and writes states through this.
struct StateSlots {
  explicit StateSlots(const Problem& p);
  // The slot sequence n starts from (n without indices); negative: padding, skip the sequence.
  int64_t initial(int64_t n) const;
  // The slot its final state goes to: final_state_indices[n], else initial(n) (none with
  // per-token states and no final_state_indices); negative: none.
  int64_t final(int64_t n) const;
  // The slot the state after token t (0-based in the sequence) goes to; negative: none.
  int64_t token(int64_t n, int64_t t) const;
  // Element (v, k) of head h of slot `slot` in a state tensor.
  int64_t element(int64_t slot, int64_t h, int64_t v, int64_t k) const {
    const int64_t base = (slot * H + h) * V * K;
    return layout == StateLayout::kVK ? base + v * K + k : base + k * V + v;
  }

  int64_t H, K, V;
  StateLayout layout;
  const void* indices;
  DType indices_dtype;
  const void* final_indices;
  DType final_indices_dtype;
  const void* token_indices;
  DType token_indices_dtype;
  int64_t token_columns;
};

}  // namespace flashkda
