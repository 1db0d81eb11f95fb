// The tool's commands and what they share: exit codes, workload flags, build information.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "args.h"
#include "workload.h"

namespace flashkda::cli {

// Exit codes of every command.
constexpr int kExitOk = 0;
constexpr int kExitFail = 1;   // the error against the oracle is above the bar, or outputs were left unwritten
constexpr int kExitUsage = 2;  // a bad command line
constexpr int kExitError = 3;  // flashkda reported an error (flashkda::Error), or another runtime failure

const char* exit_codes_help();

int run_command(int argc, char** argv, int first);
int bench_command(int argc, char** argv, int first);

// The commit the tool was built from ("unknown" outside a git checkout).
const char* build_commit();

// Flags that describe a workload, shared by run and bench.
struct WorkloadFlags {
  std::optional<std::vector<int64_t>> seq_lens;
  std::optional<int64_t> batch, seqlen, heads;
  Gate gate = Gate::kSafe;
  float lower_bound = -5.0f;
  std::optional<float> scale;
  StateKind state = StateKind::kBF16;
  bool final_state = true;
  DType cu_seqlens_dtype = DType::kI64;
  uint64_t seed = 0;
  int backend = 0;  // 0 auto, 1 cpu, 2 cuda

  bool shape_given() const { return seq_lens || batch || seqlen; }
};

void add_shape_flags(FlagParser& parser, WorkloadFlags& flags);     // --seqlens --batch --seqlen --heads
void add_numerics_flags(FlagParser& parser, WorkloadFlags& flags);  // gate, bounds, states, cu_seqlens dtype
void add_common_flags(FlagParser& parser, WorkloadFlags& flags);    // --seed --backend

// Fills spec.seq_lens / batch_form from the shape flags (default_seq_lens when none given) and
// spec.heads (default_heads unless --heads); throws UsageError on conflicting flags.
void apply_shape(const WorkloadFlags& flags, const std::string& command, const std::vector<int64_t>& default_seq_lens,
                 int64_t default_heads, WorkloadSpec& spec);
// Copies the numerics flags and the seed into spec.
void apply_numerics(const WorkloadFlags& flags, WorkloadSpec& spec);
// Before anything is allocated: throws UsageError, naming the shape flags given, when the host
// cannot hold a run of spec (see host_memory_shortfall).
void check_host_memory(const WorkloadFlags& flags, const WorkloadSpec& spec, int64_t oracle_heads, bool gpu);

// What the command is doing now ("generating the random inputs"), named by the message of an
// out-of-memory failure that no allocation site named itself. A static string; "" when idle.
void set_activity(const char* what);
const char* activity();

const char* backend_name(Backend b);
std::string format_count(double x);  // 1234567 -> "1,234,567"

}  // namespace flashkda::cli
