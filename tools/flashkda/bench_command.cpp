// `flashkda bench`: the cases P1-P11 of docs/benchmark.md (or a custom shape), printed as a table
// and written as JSON. On the GPU: median of CUDA-event timings, effective bandwidth, and the
// ratio to the floor (bytes / device copy bandwidth measured in the same run). Without a usable
// GPU: the CPU backend on scaled-down shapes, reporting token-heads per second.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <thread>

#include "commands.h"
#include "device_buffers.h"
#include "executor.h"
#include "json_writer.h"
#include "oracle_check.h"

namespace flashkda::cli {
namespace {

struct BenchCase {
  std::string name;
  std::vector<int64_t> seq_lens;
  int64_t heads;
  double goal_ms;  // docs/benchmark.md's goal on an H200 (0: none)
};

std::vector<int64_t> repeat(int64_t count, int64_t length) { return std::vector<int64_t>(count, length); }

const std::vector<BenchCase>& perf_cases() {
  static const std::vector<int64_t> mixed = {1300, 547, 2048, 963, 271, 3063};
  static const std::vector<BenchCase> cases = {
      {"P1", {8192}, 96, 0.48},          {"P2", mixed, 96, 0.49},          {"P3", repeat(8, 1024), 96, 0.50},
      {"P4", {8192}, 64, 0.32},          {"P5", mixed, 64, 0.33},          {"P6", repeat(8, 1024), 64, 0.33},
      {"P7", {32768}, 8, 0.30},          {"P8", {65536}, 4, 0.30},         {"P9", repeat(64, 128), 32, 0.22},
      {"P10", repeat(4, 16384), 16, 0.63},  {"P11", {131072}, 8, 0.8},
  };
  return cases;
}

constexpr double kCpuTargetTokenHeadsPerS = 100000.0;  // issue 2: the CPU backend on the 2-core machine

struct CaseResult {
  BenchCase c;               // as run (scaled down on the CPU)
  std::vector<int64_t> original_seq_lens;
  int64_t original_heads = 0;
  int64_t total_tokens = 0;
  double token_heads = 0, bytes = 0;
  ExecResult exec;
  OracleCheck check;
  double floor_ms = NAN, ratio_to_floor = NAN, tbps = NAN, token_heads_per_s = NAN;
  std::string error;         // a flashkda::Error raised by the case, if any
  bool pass() const { return error.empty() && check.pass() && exec.outputs_written(); }
};

std::string fmt(const char* format, double x) {
  if (!std::isfinite(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

std::string short_sequences(const std::vector<int64_t>& seq_lens) {
  const bool equal = seq_lens.size() > 1 &&
                     std::all_of(seq_lens.begin(), seq_lens.end(), [&](int64_t L) { return L == seq_lens[0]; });
  if (equal) return std::to_string(seq_lens.size()) + "x[" + std::to_string(seq_lens[0]) + "]";
  if (seq_lens.size() <= 6) return std::string("[") + join(seq_lens, ",") + "]";
  return std::string("[") + std::to_string(seq_lens.size()) + " seqs]";
}

void print_header(bool gpu) {
  if (gpu)
    std::printf("%-6s %-28s %4s %9s %9s %9s %7s %9s %8s %7s %9s %9s %s\n", "case", "seq_lens", "H", "median_ms",
                "min_ms", "max_ms", "TB/s", "floor_ms", "x_floor", "goal", "err_out", "err_state", "check");
  else
    std::printf("%-6s %-28s %4s %9s %9s %9s %16s %9s %9s %s\n", "case", "seq_lens (scaled)", "H", "median_ms",
                "min_ms", "max_ms", "token-heads/s", "err_out", "err_state", "check");
}

void print_row(const CaseResult& r, bool gpu) {
  const std::string check = !r.error.empty() ? "ERROR" : r.pass() ? "PASS" : "FAIL";
  const std::string err_out = r.check.heads.empty() ? "-" : fmt("%.2e", r.check.out_rel);
  const std::string err_state = r.check.heads.empty() || !r.check.has_final_state ? "-" : fmt("%.2e", r.check.final_state_rel);
  if (gpu)
    std::printf("%-6s %-28s %4lld %9s %9s %9s %7s %9s %8s %7s %9s %9s %s\n", r.c.name.c_str(),
                short_sequences(r.c.seq_lens).c_str(), static_cast<long long>(r.c.heads),
                fmt("%.4f", r.exec.ms.median).c_str(), fmt("%.4f", r.exec.ms.min).c_str(),
                fmt("%.4f", r.exec.ms.max).c_str(), fmt("%.2f", r.tbps).c_str(), fmt("%.4f", r.floor_ms).c_str(),
                fmt("%.2f", r.ratio_to_floor).c_str(), r.c.goal_ms > 0 ? fmt("%.2f", r.c.goal_ms).c_str() : "-",
                err_out.c_str(), err_state.c_str(), check.c_str());
  else
    std::printf("%-6s %-28s %4lld %9s %9s %9s %16s %9s %9s %s\n", r.c.name.c_str(),
                short_sequences(r.c.seq_lens).c_str(), static_cast<long long>(r.c.heads),
                fmt("%.3f", r.exec.ms.median).c_str(), fmt("%.3f", r.exec.ms.min).c_str(),
                fmt("%.3f", r.exec.ms.max).c_str(), format_count(r.token_heads_per_s).c_str(), err_out.c_str(),
                err_state.c_str(), check.c_str());
  if (!r.error.empty()) std::printf("       error: %s\n", r.error.c_str());
  std::fflush(stdout);
}

Json case_json(const CaseResult& r, bool gpu) {
  Json j;
  j["name"] = r.c.name;
  j["seq_lens"] = r.c.seq_lens;
  j["heads"] = r.c.heads;
  if (!gpu) {
    j["original_seq_lens"] = r.original_seq_lens;
    j["original_heads"] = r.original_heads;
  }
  j["total_tokens"] = r.total_tokens;
  // Counts of token-heads and bytes: whole numbers, written as such.
  j["token_heads"] = static_cast<int64_t>(r.token_heads);
  j["floor_bytes"] = static_cast<int64_t>(r.bytes);
  if (!r.error.empty()) {
    j["error"] = r.error;
    return j;
  }
  j["median_ms"] = r.exec.ms.median;
  j["min_ms"] = r.exec.ms.min;
  j["max_ms"] = r.exec.ms.max;
  j["samples_ms"] = r.exec.samples_ms;
  j["token_heads_per_s"] = r.token_heads_per_s;
  if (gpu) {
    j["effective_tbps"] = r.tbps;
    j["floor_ms"] = r.floor_ms;
    j["ratio_to_floor"] = r.ratio_to_floor;
    if (r.c.goal_ms > 0) j["goal_ms"] = r.c.goal_ms;
    j["input_sets"] = r.exec.input_sets;
    j["workspace_bytes"] = static_cast<int64_t>(r.exec.workspace_bytes);
  }
  j["outputs_written"] = r.exec.outputs_written();
  Json oracle;
  oracle["heads"] = r.check.heads;
  if (r.check.heads.empty()) {
    oracle["skipped"] = true;
  } else {
    oracle["out_rel"] = r.check.out_rel;
    oracle["final_state_rel"] = r.check.final_state_rel;
    oracle["bar"] = kErrorBar;
  }
  oracle["pass"] = r.check.pass();
  j["oracle"] = std::move(oracle);
  j["pass"] = r.pass();
  return j;
}

}  // namespace

int bench_command(int argc, char** argv, int first) {
  WorkloadFlags flags;
  std::vector<std::string> case_names;
  std::string json_path = "bench-results.json";
  std::string commit = build_commit();
  std::optional<int> iters, warmup;
  int oracle_heads = 2, input_sets = 0;
  int64_t cpu_divisor = 16, cpu_max_heads = 8;
  bool list = false;

  FlagParser parser("flashkda bench", "flashkda bench [flags]",
                    "Benchmarks KDA forward on the cases P1-P11 of docs/benchmark.md (K = V = 128, bf16 inputs,\n"
                    "bf16 initial and final state, safe gate with lower_bound -5, packed int64 cu_seqlens,\n"
                    "random inputs), or on a custom shape. Prints a table and writes JSON.\n"
                    "\n"
                    "GPU method: inputs rotate among enough device copies that one pass exceeds 3x the L2;\n"
                    "outputs are poisoned (0xFF) before the timed calls and checked written after; warm-up;\n"
                    "median of CUDA-event timings of single forward calls; the floor is the bytes of\n"
                    "docs/benchmark.md's formula over the device-to-device copy bandwidth measured in the same run.\n"
                    "Without a usable GPU (or with --backend cpu) the CPU backend runs scaled-down shapes\n"
                    "(sequence lengths / 16, heads capped at 8) and reports token-heads per second.");
  parser.add("--case", "P1,P3,...", "cases to run (default: all of P1-P11)", [&](const std::string& v) {
    for (const std::string& name : split(v, ',')) {
      bool known = false;
      for (const BenchCase& c : perf_cases()) known |= c.name == name;
      if (!known) throw UsageError("--case: expected case names P1..P11 (comma-separated), got '" + name + "'");
      case_names.push_back(name);
    }
  });
  parser.add_switch("--list", "list the cases and exit", [&] { list = true; });
  add_shape_flags(parser, flags);
  parser.add("--json", "PATH", "where the JSON results go (default bench-results.json)",
             [&](const std::string& v) {
               if (v.empty()) throw UsageError("--json: expected a file path, got ''");
               json_path = v;
             });
  parser.add("--commit", "ID", "commit recorded in the JSON (default: the commit the tool was built from)",
             [&](const std::string& v) { commit = v; });
  parser.add("--iters", "N", "timed calls per case (default 30 on the GPU, 10 on the CPU)",
             [&](const std::string& v) { iters = static_cast<int>(parse_int("--iters", v, 1, 100000)); });
  parser.add("--warmup", "N", "untimed calls per case before the timed ones (default 10 on the GPU, 2 on the CPU)",
             [&](const std::string& v) { warmup = static_cast<int>(parse_int("--warmup", v, 0, 100000)); });
  parser.add("--oracle-heads", "N", "heads per case checked against the fp64 oracle (default 2; 0 skips)",
             [&](const std::string& v) { oracle_heads = static_cast<int>(parse_int("--oracle-heads", v, 0, 4096)); });
  parser.add("--input-sets", "N", "GPU: device copies of the inputs to rotate (default: enough for 3x the L2)",
             [&](const std::string& v) { input_sets = static_cast<int>(parse_int("--input-sets", v, 1, 1024)); });
  parser.add("--cpu-divisor", "D", "CPU: divide each case's sequence lengths by D (default 16)",
             [&](const std::string& v) { cpu_divisor = parse_int("--cpu-divisor", v, 1, 1 << 20); });
  parser.add("--cpu-max-heads", "H", "CPU: cap each case's heads at H (default 8)",
             [&](const std::string& v) { cpu_max_heads = parse_int("--cpu-max-heads", v, 1, 4096); });
  add_common_flags(parser, flags);
  parser.set_epilog(std::string(exit_codes_help()) +
                    "\nexamples:\n"
                    "  flashkda bench\n"
                    "  flashkda bench --case P7,P8 --json p7p8.json\n"
                    "  flashkda bench --seqlens 4096,4096 --heads 32\n");
  if (!parser.parse(argc, argv, first)) return kExitOk;

  if (list) {
    std::printf("%-5s %-36s %s\n", "case", "seq_lens", "H");
    for (const BenchCase& c : perf_cases())
      std::printf("%-5s %-36s %lld\n", c.name.c_str(), short_sequences(c.seq_lens).c_str(),
                  static_cast<long long>(c.heads));
    return kExitOk;
  }
  if (flags.shape_given() && !case_names.empty())
    throw UsageError("flashkda bench: give either --case or a custom shape (--seqlens / --batch --seqlen), not both");
  if (flags.heads && !flags.shape_given())
    throw UsageError("flashkda bench: --heads goes with a custom shape (--seqlens or --batch with --seqlen)");

  // Before any work: a --json path that cannot be written fails now, not after the run.
  JsonFile json_file(json_path, "--json");

  std::string why_cpu;
  const Backend backend = resolve_backend(flags.backend, &why_cpu);
  const bool gpu = backend == Backend::kCuda;

  // The cases to run, as given, then scaled down on the CPU.
  std::vector<BenchCase> cases;
  if (flags.shape_given()) {
    WorkloadSpec custom;
    apply_shape(flags, "flashkda bench", {}, 8, custom);
    check_host_memory(flags, custom, oracle_heads, gpu);
    cases.push_back({"custom", custom.seq_lens, custom.heads, 0});
  } else {
    for (const BenchCase& c : perf_cases())
      if (case_names.empty() || std::find(case_names.begin(), case_names.end(), c.name) != case_names.end())
        cases.push_back(c);
  }
  const bool scaled = !gpu && !flags.shape_given();

  std::printf("flashkda %s bench, commit %s\n", version(), commit.c_str());
  double copy_bandwidth = NAN;
  std::string device;
  if (gpu) {
    device = cuda_device_name();
    std::printf("device: %s (L2 %.0f MB)\n", device.c_str(), device_l2_bytes() / 1e6);
    std::cerr << "[bench] measuring the device-to-device copy bandwidth" << std::endl;
    Stream stream;
    const size_t copy_bytes = std::min<size_t>(size_t{1} << 30, device_free_bytes() / 4);
    copy_bandwidth = measure_copy_bandwidth(copy_bytes, 20, stream.get());
    std::printf("copy bandwidth: %.3f TB/s (cudaMemcpyAsync device to device, %.0f MB, bytes read + written, median of 20)\n",
                copy_bandwidth / 1e12, copy_bytes / 1e6);
  } else {
    std::printf("device: none used: CPU backend (%s)\n", why_cpu.c_str());
    if (scaled)
      std::printf("NOTE: CPU run on SCALED-DOWN shapes (sequence lengths / %lld, heads capped at %lld); the times\n"
                  "      are not comparable with the GPU figures of docs/benchmark.md. Throughput is in token-heads\n"
                  "      per second.\n",
                  static_cast<long long>(cpu_divisor), static_cast<long long>(cpu_max_heads));
  }
  std::printf("\n");
  print_header(gpu);

  ExecSettings settings;
  settings.backend = backend;
  settings.iters = iters.value_or(gpu ? 30 : 10);
  settings.warmup = warmup.value_or(gpu ? 10 : 2);
  settings.input_sets = input_sets;
  settings.progress = true;

  std::vector<CaseResult> results;
  int index = 0;
  for (const BenchCase& original : cases) {
    ++index;
    CaseResult r;
    r.c = original;
    r.original_seq_lens = original.seq_lens;
    r.original_heads = original.heads;
    if (scaled) {
      for (int64_t& L : r.c.seq_lens) L = std::max<int64_t>(1, (L + cpu_divisor / 2) / cpu_divisor);
      r.c.heads = std::min(r.c.heads, cpu_max_heads);
    }
    WorkloadSpec spec;
    spec.seq_lens = r.c.seq_lens;
    spec.heads = r.c.heads;
    spec.seed = flags.seed + static_cast<uint64_t>(index);
    const Shape shape = shape_of(spec);
    r.total_tokens = shape.total_tokens;
    r.token_heads = static_cast<double>(shape.total_tokens) * static_cast<double>(shape.H);
    r.bytes = floor_bytes(spec);
    settings.label = "bench " + r.c.name + " " + std::to_string(index) + "/" + std::to_string(cases.size());
    try {
      // A built-in case too large for this host's memory is reported as that case's error.
      if (std::string shortfall = host_memory_shortfall(spec, oracle_heads, gpu); !shortfall.empty())
        throw HostAllocError(shortfall);
      std::cerr << "[" << settings.label << "] " << describe_sequences(spec.seq_lens) << " x " << spec.heads
                << " heads: generating inputs" << std::endl;
      set_activity("generating the random inputs");
      const HostInputs inputs = make_host_inputs(spec);
      set_activity("running the forward calls");
      r.exec = execute(inputs, settings);
      const std::vector<int64_t> heads = pick_heads(shape.H, oracle_heads);
      if (!heads.empty())
        std::cerr << "[" << settings.label << "] fp64 oracle on " << heads.size() << " head(s)" << std::endl;
      set_activity("checking against the fp64 oracle");
      r.check = check_against_oracle(inputs, r.exec.out.data(),
                                     r.exec.final_state.empty() ? nullptr : r.exec.final_state.data(), heads);
      const double seconds = r.exec.ms.median * 1e-3;
      r.token_heads_per_s = r.token_heads / seconds;
      if (gpu) {
        r.tbps = r.bytes / seconds / 1e12;
        r.floor_ms = r.bytes / copy_bandwidth * 1e3;
        r.ratio_to_floor = r.exec.ms.median / r.floor_ms;
      }
    } catch (const Error& e) {
      r.error = e.what();
    } catch (const HostAllocError& e) {
      r.error = e.what();
    } catch (const std::bad_alloc&) {
      r.error = std::string("out of host memory (std::bad_alloc) while ") + activity();
    }
    set_activity("");
    r.exec.out = {};  // the outputs are not needed any more
    r.exec.final_state = {};
    print_row(r, gpu);
    results.push_back(std::move(r));
  }

  // CPU throughput over all cases that ran: total token-heads over total median time.
  double total_token_heads = 0, total_seconds = 0, slowest = INFINITY;
  std::string slowest_case;
  bool all_pass = true, any_error = false;
  for (const CaseResult& r : results) {
    all_pass &= r.pass();
    any_error |= !r.error.empty();
    if (!r.error.empty()) continue;
    total_token_heads += r.token_heads;
    total_seconds += r.exec.ms.median * 1e-3;
    if (r.token_heads_per_s < slowest) slowest = r.token_heads_per_s, slowest_case = r.c.name;
  }
  const double aggregate = total_seconds > 0 ? total_token_heads / total_seconds : NAN;
  std::printf("\n");
  if (!gpu) {
    std::printf("CPU throughput: %s token-heads/s over all cases (slowest case %s: %s token-heads/s); target >= %s: %s\n",
                format_count(aggregate).c_str(), slowest_case.c_str(), format_count(slowest).c_str(),
                format_count(kCpuTargetTokenHeadsPerS).c_str(),
                aggregate >= kCpuTargetTokenHeadsPerS ? (slowest >= kCpuTargetTokenHeadsPerS ? "met, every case" : "met overall, not by every case")
                                                      : "NOT met");
  }

  Json j;
  j["tool"] = "flashkda bench";
  j["version"] = version();
  j["commit"] = commit;
  j["backend"] = backend_name(backend);
  if (gpu) {
    j["device"] = device;
    j["copy_bandwidth_tbps"] = copy_bandwidth / 1e12;
    j["l2_bytes"] = static_cast<int64_t>(device_l2_bytes());
  } else {
    j["device"] = nullptr;
    j["cpu_reason"] = why_cpu;
    j["cpu_threads"] = static_cast<int64_t>(std::thread::hardware_concurrency());
  }
  j["scaled_down"] = scaled;
  if (scaled)
    j["scale_note"] = "CPU backend on scaled-down shapes: sequence lengths / " + std::to_string(cpu_divisor) +
                      ", heads capped at " + std::to_string(cpu_max_heads) +
                      "; not comparable with the GPU figures of docs/benchmark.md";
  Json method;
  method["timer"] = gpu ? "CUDA events, one forward call each" : "steady_clock, one forward call each";
  method["warmup"] = settings.warmup;
  method["iters"] = settings.iters;
  method["statistic"] = "median";
  method["head_dim"] = kHeadDim;
  method["gate"] = "safe";
  method["lower_bound"] = -5;
  method["state_dtype"] = "bf16";
  method["cu_seqlens"] = "int64, packed (B = 1)";
  method["floor_bytes"] = "T*H*128*2*5 + T*H*2 + N*H*128*128*2*2";
  method["seed"] = flags.seed;
  j["method"] = std::move(method);
  Json case_list = Json::array();
  for (const CaseResult& r : results) case_list.push_back(case_json(r, gpu));
  j["cases"] = std::move(case_list);
  j["token_heads_per_s_overall"] = aggregate;
  if (!gpu) {
    j["cpu_target_token_heads_per_s"] = static_cast<int64_t>(kCpuTargetTokenHeadsPerS);
    j["cpu_target_met"] = aggregate >= kCpuTargetTokenHeadsPerS;
    j["cpu_target_met_every_case"] = slowest >= kCpuTargetTokenHeadsPerS;
  }
  j["all_pass"] = all_pass;
  set_activity("writing the JSON results");
  json_file.write(j);
  std::printf("results written to %s\n", json_path.c_str());

  if (any_error) return kExitError;
  return all_pass ? kExitOk : kExitFail;
}

}  // namespace flashkda::cli
