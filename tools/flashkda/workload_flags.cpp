// The flags that describe a workload, shared by `run` and `bench`.
#include <cmath>

#include "commands.h"

namespace flashkda::cli {

namespace {
constexpr int64_t kMaxTokens = int64_t{1} << 31;
constexpr int64_t kMaxHeads = 4096;
}  // namespace

void add_shape_flags(FlagParser& parser, WorkloadFlags& f) {
  parser.add("--seqlens", "L1,L2,...", "sequence lengths, packed into one batch row with cu_seqlens",
             [&f](const std::string& v) { f.seq_lens = parse_int_list("--seqlens", v, 0, kMaxTokens); });
  parser.add("--batch", "B", "B sequences of equal length as [B, T] rows, no cu_seqlens (with --seqlen)",
             [&f](const std::string& v) { f.batch = parse_int("--batch", v, 1, 1 << 20); });
  parser.add("--seqlen", "T", "the length of each of the --batch sequences",
             [&f](const std::string& v) { f.seqlen = parse_int("--seqlen", v, 0, kMaxTokens); });
  parser.add("--heads", "H", "number of heads",
             [&f](const std::string& v) { f.heads = parse_int("--heads", v, 1, kMaxHeads); });
}

void add_numerics_flags(FlagParser& parser, WorkloadFlags& f) {
  parser.add("--gate", "safe|softplus",
             "gate activation: safe (lower_bound * sigmoid(...)) or softplus\n"
             "(-exp(A_log) * softplus(...)); default safe",
             [&f](const std::string& v) {
               f.gate = parse_choice("--gate", v, {"safe", "softplus"}) == 0 ? Gate::kSafe : Gate::kSoftplus;
             });
  parser.add("--lower-bound", "X", "lower bound of the safe gate; the library accepts [-5, 0); default -5",
             [&f](const std::string& v) { f.lower_bound = static_cast<float>(parse_double("--lower-bound", v)); });
  parser.add("--scale", "X", "output scale; default 128^-0.5",
             [&f](const std::string& v) { f.scale = static_cast<float>(parse_double("--scale", v)); });
  parser.add("--state", "bf16|f32|none",
             "dtype of the initial and final state, or none for no initial state\n"
             "(the final state is then bf16); default bf16",
             [&f](const std::string& v) {
               const int c = parse_choice("--state", v, {"bf16", "f32", "none"});
               f.state = c == 0 ? StateKind::kBF16 : c == 1 ? StateKind::kF32 : StateKind::kNone;
             });
  parser.add_switch("--no-final-state", "do not ask for the final state", [&f] { f.final_state = false; });
  parser.add("--cu-seqlens-dtype", "i64|i32", "dtype of cu_seqlens for packed sequences; default i64",
             [&f](const std::string& v) {
               f.cu_seqlens_dtype = parse_choice("--cu-seqlens-dtype", v, {"i64", "i32"}) == 0 ? DType::kI64 : DType::kI32;
             });
}

void add_common_flags(FlagParser& parser, WorkloadFlags& f) {
  parser.add("--seed", "N", "seed of the random inputs; default 0",
             [&f](const std::string& v) { f.seed = parse_uint64("--seed", v); });
  parser.add("--backend", "auto|cpu|cuda",
             "where to run: cuda when built with CUDA and a device is present\n"
             "(auto, the default), or forced",
             [&f](const std::string& v) { f.backend = parse_choice("--backend", v, {"auto", "cpu", "cuda"}); });
}

void apply_shape(const WorkloadFlags& f, const std::string& command, const std::vector<int64_t>& default_seq_lens,
                 int64_t default_heads, WorkloadSpec& spec) {
  if (f.seq_lens && (f.batch || f.seqlen))
    throw UsageError(command + ": give either --seqlens or --batch with --seqlen, not both");
  if (f.batch.has_value() != f.seqlen.has_value())
    throw UsageError(command + ": --batch and --seqlen go together (B sequences of T tokens each)");
  spec.batch_form = false;
  if (f.seq_lens) {
    spec.seq_lens = *f.seq_lens;
  } else if (f.batch) {
    spec.seq_lens.assign(*f.batch, *f.seqlen);
    spec.batch_form = true;
  } else {
    spec.seq_lens = default_seq_lens;
  }
  spec.heads = f.heads.value_or(default_heads);
}

void apply_numerics(const WorkloadFlags& f, WorkloadSpec& spec) {
  spec.gate = f.gate;
  spec.lower_bound = f.lower_bound;
  spec.scale = f.scale.value_or(static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim))));
  spec.state = f.state;
  spec.final_state = f.final_state;
  spec.cu_seqlens_dtype = f.cu_seqlens_dtype;
  spec.seed = f.seed;
}

void check_host_memory(const WorkloadFlags& f, const WorkloadSpec& spec, int64_t oracle_heads, bool gpu) {
  const std::string shortfall = host_memory_shortfall(spec, oracle_heads, gpu);
  if (shortfall.empty()) return;
  std::string given = f.seq_lens ? "--seqlens" : f.batch ? "--batch/--seqlen" : "";
  if (f.heads) given += given.empty() ? "--heads" : " with --heads";
  throw UsageError((given.empty() ? std::string("the default workload: ") : given + ": ") + shortfall +
                   ": give fewer or shorter sequences, or fewer heads");
}

namespace {
const char* current_activity = "";
}  // namespace

void set_activity(const char* what) { current_activity = what; }
const char* activity() { return *current_activity ? current_activity : "starting"; }

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kCpu: return "cpu";
    case Backend::kCuda: return "cuda";
    default: return "none";
  }
}

std::string format_count(double x) {
  if (!std::isfinite(x)) return "n/a";
  std::string digits = std::to_string(static_cast<long long>(std::llround(x)));
  std::string r;
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    r += digits[i];
    if (digits[i] != '-' && (n - 1 - i) % 3 == 0 && i + 1 < n) r += ',';
  }
  return r;
}

const char* exit_codes_help() {
  return "exit codes:\n"
         "  0  success (the error against the oracle within the bar)\n"
         "  1  the error against the oracle is above the bar (or NaN/Inf), or outputs were left unwritten\n"
         "  2  a bad command line\n"
         "  3  flashkda reported an error (message printed), or another runtime failure\n";
}

}  // namespace flashkda::cli
