// Timed forward calls of one workload on one backend, shared by `run` and `bench`.
//
// Method: one untimed call that validates everything (cu_seqlens checked on the host), warm-up
// calls, outputs poisoned with 0xFF bytes, then `iters` timed calls, each timed on its own
// (CUDA events on the GPU, a steady clock on the CPU); afterwards the outputs are checked to be
// written and the first input set's outputs are copied back for the oracle check. On the GPU,
// inputs rotate among enough device copies that one pass over them exceeds 3x the L2 cache.
//
// With a state pool (decode, updated in place): one pool, shared by all calls; call i uses
// index set i % index_sets (disjoint slots) and its own copy of the activations and out. The
// first call, on the pool as generated, is the one checked against the oracle: its out and the
// slots it wrote are kept. Before the timed calls the pool is restored as generated, out and the
// token-state slots (written, never read) are poisoned; afterwards out and the token slots must
// hold no poison, and every (slot, head) state written in place must differ from its value
// before the timed calls. Prefix checkpoints (with a pool) are outputs like out: each index set
// has its own, poisoned before the timed calls and checked written after; the first call's are
// kept for the oracle check.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stats.h"
#include "workload.h"

namespace flashkda::cli {

struct ExecSettings {
  Backend backend = Backend::kCpu;
  int warmup = 1;
  int iters = 5;
  int input_sets = 0;        // GPU: 0 picks the count from the L2 size; the CPU always uses 1
  bool progress = false;     // progress lines on stderr
  std::string label;         // prefix of the progress lines
};

struct ExecResult {
  TimingStats ms;                   // per call, milliseconds
  std::vector<double> samples_ms;
  int input_sets = 1;                // with a pool: the index sets
  int sets_checked = 1;             // input sets whose outputs were checked for poison
  int64_t unwritten_out = 0;        // output elements still holding the poison after the timed runs
  int64_t unwritten_final_state = 0;
  int64_t unwritten_checkpoints = 0;
  size_t workspace_bytes = 0;
  HostVector<uint16_t> out;                  // the first input set's out, on the host
  HostVector<unsigned char> final_state;     // and its final state (empty without one); with a
                                             // pool, the states the first call wrote, packed in
                                             // the order of HostInputs::written_slots(0)
  HostVector<float> checkpoint_state;        // the first call's checkpoints [N, C, H, V, K] (empty without)
  bool outputs_written() const {
    return unwritten_out == 0 && unwritten_final_state == 0 && unwritten_checkpoints == 0;
  }
};

ExecResult execute(const HostInputs& in, const ExecSettings& settings);

// Resolves --backend auto|cpu|cuda (0, 1, 2) to the backend used; throws Error(kNoDevice) when
// cuda is asked for and cannot run. *why_cpu tells why auto fell back to the CPU.
Backend resolve_backend(int choice, std::string* why_cpu);

}  // namespace flashkda::cli
