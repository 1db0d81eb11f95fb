// The CPU backend: the chunked form of docs/contract.md (chunk 16) in fp32, threads over (sequence, head).
#pragma once

#include "common/problem.h"

namespace flashkda {

// Writes p.out (bf16) and, when given, p.final_state (bf16 or f32). Host pointers only.
void cpu_forward(const Problem& p);

}  // namespace flashkda
