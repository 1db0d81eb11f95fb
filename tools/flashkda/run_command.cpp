// `flashkda run`: the main job on a built-in Kimi-Linear-like prefill (or the shape the flags
// give), on the GPU when one is usable, else on the CPU backend; prints the backend, shapes,
// time, throughput and the error against the fp64 oracle on a slice of heads.
#include <cstdio>
#include <iostream>

#include "commands.h"
#include "executor.h"
#include "oracle_check.h"

namespace flashkda::cli {
namespace {

// A Kimi-Linear-like prefill: several sequences of mixed lengths, 32 heads on the GPU; a
// smaller one on the CPU so that it finishes in a few seconds.
const std::vector<int64_t> kGpuDefaultSeqLens = {1300, 547, 2048, 963, 271, 3063};
constexpr int64_t kGpuDefaultHeads = 32;
const std::vector<int64_t> kCpuDefaultSeqLens = {300, 157, 512};
constexpr int64_t kCpuDefaultHeads = 8;

std::string fmt(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

void line(const char* label, const std::string& text) { std::printf("%-12s %s\n", label, text.c_str()); }

}  // namespace

int run_command(int argc, char** argv, int first) {
  WorkloadFlags flags;
  std::optional<int> iters, warmup;
  int oracle_heads = 2;

  FlagParser parser("flashkda run", "flashkda run [flags]",
                    "Runs KDA forward on a built-in Kimi-Linear-like prefill with random inputs (K = V = 128,\n"
                    "safe gate with lower_bound -5, bf16 states): on the GPU 6 sequences [1300, 547, 2048, 963,\n"
                    "271, 3063] x 32 heads, on the CPU backend 3 sequences [300, 157, 512] x 8 heads. Prints the\n"
                    "backend, shapes, time, throughput and the error against the fp64 oracle on a slice of heads\n"
                    "(all sequences), and PASS when both errors are within the bar of 3e-3 (docs/contract.md).");
  add_shape_flags(parser, flags);
  add_numerics_flags(parser, flags);
  add_common_flags(parser, flags);
  parser.add("--iters", "N", "timed calls; the median is reported (default 20 on the GPU, 5 on the CPU)",
             [&](const std::string& v) { iters = static_cast<int>(parse_int("--iters", v, 1, 100000)); });
  parser.add("--warmup", "N", "untimed calls before the timed ones (default 5 on the GPU, 1 on the CPU)",
             [&](const std::string& v) { warmup = static_cast<int>(parse_int("--warmup", v, 0, 100000)); });
  parser.add("--oracle-heads", "N", "heads checked against the fp64 oracle (default 2; 0 skips the check)",
             [&](const std::string& v) { oracle_heads = static_cast<int>(parse_int("--oracle-heads", v, 0, 4096)); });
  parser.set_epilog(std::string(exit_codes_help()) +
                    "\nexamples:\n"
                    "  flashkda run\n"
                    "  flashkda run --seqlens 8192 --heads 8 --gate softplus --state f32\n"
                    "  flashkda run --batch 4 --seqlen 1000 --backend cpu\n");
  if (!parser.parse(argc, argv, first)) return kExitOk;

  std::string why_cpu;
  const Backend backend = resolve_backend(flags.backend, &why_cpu);
  const bool gpu = backend == Backend::kCuda;

  WorkloadSpec spec;
  apply_shape(flags, "flashkda run", gpu ? kGpuDefaultSeqLens : kCpuDefaultSeqLens,
              gpu ? kGpuDefaultHeads : kCpuDefaultHeads, spec);
  apply_numerics(flags, spec);
  check_host_memory(flags, spec, oracle_heads, gpu);
  const Shape shape = shape_of(spec);

  std::printf("flashkda %s (commit %s)\n", version(), build_commit());
  line("backend", gpu ? "cuda: " + cuda_device_name() : "cpu (" + why_cpu + ")");
  line("problem", describe_sequences(spec.seq_lens) + " x " + std::to_string(shape.H) + " heads, K = V = " +
                      std::to_string(kHeadDim));
  line("layout", shape.packed ? "packed [1, " + std::to_string(shape.T) + ", " + std::to_string(shape.H) +
                                    ", 128] with " + dtype_name(spec.cu_seqlens_dtype) + " cu_seqlens"
                              : "batch [" + std::to_string(shape.B) + ", " + std::to_string(shape.T) + ", " +
                                    std::to_string(shape.H) + ", 128], no cu_seqlens");
  line("gate", spec.gate == Gate::kSafe ? "safe, lower_bound " + fmt("%g", spec.lower_bound) + ", scale " +
                                              fmt("%g", spec.scale)
                                        : "softplus, scale " + fmt("%g", spec.scale));
  line("state", std::string("initial ") + state_kind_name(spec.state) + ", final " +
                    (spec.final_state ? (shape.state_dtype == DType::kF32 ? "f32" : "bf16") : "none"));
  std::fflush(stdout);

  ExecSettings settings;
  settings.backend = backend;
  settings.iters = iters.value_or(gpu ? 20 : 5);
  settings.warmup = warmup.value_or(gpu ? 5 : 1);
  settings.label = "run";
  const double token_heads = static_cast<double>(shape.total_tokens) * static_cast<double>(shape.H);
  settings.progress = token_heads * (gpu ? 1e-3 : 1.0) > 2e5;  // runs of more than a second or two

  if (settings.progress) std::cerr << "[run] generating random inputs" << std::endl;
  set_activity("generating the random inputs");
  const HostInputs inputs = make_host_inputs(spec);
  set_activity("running the forward calls");
  const ExecResult r = execute(inputs, settings);

  line("time", fmt("median %.4g ms", r.ms.median) + fmt(" (min %.4g", r.ms.min) + fmt(", max %.4g)", r.ms.max) +
                   " over " + std::to_string(r.ms.count) + " calls after " + std::to_string(settings.warmup) +
                   " warm-up" + (gpu ? ", CUDA events" : ""));
  line("throughput", format_count(token_heads / (r.ms.median * 1e-3)) + " token-heads/s (" +
                         format_count(token_heads) + " token-heads per call)");
  if (gpu) {
    line("bandwidth", fmt("%.3f TB/s effective", floor_bytes(spec) / (r.ms.median * 1e-3) / 1e12) +
                          " (bytes of the floor formula / median time)");
    if (r.input_sets > 1) line("inputs", "rotated among " + std::to_string(r.input_sets) + " device copies");
  }
  line("outputs", r.outputs_written() ? std::string("all written")
                                      : format_count(static_cast<double>(r.unwritten_out)) + " out and " +
                                            format_count(static_cast<double>(r.unwritten_final_state)) +
                                            " final_state elements left unwritten");

  const std::vector<int64_t> heads = pick_heads(shape.H, oracle_heads);
  if (settings.progress && !heads.empty())
    std::cerr << "[run] running the fp64 oracle on " << heads.size() << " head(s)" << std::endl;
  set_activity("checking against the fp64 oracle");
  const OracleCheck check = check_against_oracle(inputs, r.out.data(),
                                                 r.final_state.empty() ? nullptr : r.final_state.data(), heads);
  if (heads.empty()) {
    line("oracle", "skipped (--oracle-heads 0)");
  } else {
    const std::string sequences =
        shape.N == 1 ? std::string("the one sequence") : "all " + std::to_string(shape.N) + " sequences";
    std::string text = "heads " + join(heads) + " of " + std::to_string(shape.H) + " (" + sequences +
                       "): out rel " + fmt("%.2e", check.out_rel);
    if (check.has_final_state) text += ", final_state rel " + fmt("%.2e", check.final_state_rel);
    text += fmt(" (bar %.0e", kErrorBar) + fmt(", fp64 oracle %.2f s)", check.seconds);
    line("oracle", text);
  }
  const bool pass = check.pass() && r.outputs_written();
  line("result", std::string(pass ? "PASS" : "FAIL") + (heads.empty() ? " (outputs written; no oracle check)" : ""));
  return pass ? kExitOk : kExitFail;
}

}  // namespace flashkda::cli
