// fp64 references. oracle_forward is the per-token definition of docs/contract.md, literally; it is the
// reference every other path is tested against. oracle_forward_chunked is the chunked form in
// fp64, kept to show the chunked algebra equals the definition.
#pragma once

#include "common/problem.h"

namespace flashkda {

// out: [B*T, H, V] doubles. final_state: [N, H, V, K] doubles (one per sequence, V-major,
// whatever p's state pools and layout), or nullptr. Reads p's inputs (host pointers; the initial
// state from each sequence's slot) and ignores p.out / p.final_state. Padding sequences (negative
// state index) are skipped: their rows of out and final_state are not written.
void oracle_forward(const Problem& p, double* out, double* final_state);

// The chunked form (chunk = C tokens). Same outputs as oracle_forward up to fp64 rounding.
void oracle_forward_chunked(const Problem& p, int chunk, double* out, double* final_state);

}  // namespace flashkda
