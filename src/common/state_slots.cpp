#include "common/problem.h"

namespace flashkda {
StateSlots::StateSlots(const Problem& p)
    : H(p.H),
      K(p.K),
      V(p.V),
      layout(p.state_layout),
      indices(p.state_indices),
      indices_dtype(p.state_indices_dtype),
      final_indices(p.final_state_indices),
      final_indices_dtype(p.final_state_indices_dtype),
      token_indices(p.token_state_indices),
      token_indices_dtype(p.token_state_indices_dtype),
      token_columns(p.token_state_columns) {}

int64_t host_checkpoint_offset(const Problem& p, int64_t n, int64_t c) {
  return host_index(p.checkpoint_offsets, p.checkpoint_offsets_dtype, n * p.checkpoints + c);
}

int64_t StateSlots::initial(int64_t n) const { return indices ? host_index(indices, indices_dtype, n) : n; }

int64_t StateSlots::final(int64_t n) const {
  if (final_indices) return host_index(final_indices, final_indices_dtype, n);
  return token_indices ? -1 : initial(n);
}

int64_t StateSlots::token(int64_t n, int64_t t) const {
  return token_indices ? host_index(token_indices, token_indices_dtype, n * token_columns + t) : -1;
}

}  // namespace flashkda
