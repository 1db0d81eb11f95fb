// Argument validation for forward(): every message names the argument, the expectation and the
// value given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fail.h"
#include "common/problem.h"

namespace flashkda {

std::string shape_string(const Tensor& t);

// Checks dtypes, shapes, alignment and scalars, and returns the typed problem. Does not look at
// where the pointers live, nor at the values inside cu_seqlens.
Problem validate_forward(const ForwardArgs& args);

// Checks host-readable token offsets (N + 1 entries, from cu_seqlens): start at 0,
// non-decreasing, end at total_tokens.
void validate_sequence_offsets(const std::vector<int64_t>& offsets, int64_t total_tokens);

// Checks host-readable state indices (offsets: the sequences' token offsets): every slot inside
// its pool, no slot written twice, no slot written by one sequence and read by another from the
// same buffer, and per-token indices for every token.
void validate_state_slots(const Problem& p, const std::vector<int64_t>& offsets);

// Checks host-readable checkpoint offsets against the sequences' token offsets: multiples of 16,
// within the sequence, non-decreasing (negative entries are unused).
void validate_checkpoint_offsets(const Problem& p, const std::vector<int64_t>& offsets);

}  // namespace flashkda
