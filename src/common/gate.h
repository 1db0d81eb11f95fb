// The gate and beta activations of docs/contract.md, in natural-log units, for any float type.
#pragma once

#include <cmath>

#include "flashkda/flashkda.h"

namespace flashkda {

template <typename F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// softplus(x) = log(1 + exp(x)), computed without overflow.
template <typename F>
inline F softplus(F x) {
  return x > F(20) ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

// Log-decay a of one key channel: g is the raw gate, A_log and dt_bias the head's parameters.
template <typename F>
inline F gate_log_decay(Gate gate, F g, F A_log, F dt_bias, F lower_bound) {
  const F x = g + dt_bias;
  if (gate == Gate::kSafe) return lower_bound * sigmoid(std::exp(A_log) * x);
  return -std::exp(A_log) * softplus(x);
}

}  // namespace flashkda
