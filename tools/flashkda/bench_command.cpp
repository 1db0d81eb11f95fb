// `flashkda bench`: the prefill cases P1-P11, the decode cases D1-D4 and the serving rows (P1-pool
// and the like, only with --case) of docs/benchmark.md (or a custom shape), printed as a table and
// written as JSON. On the GPU: median of CUDA-event timings, effective bandwidth, and the ratio to
// the floor (bytes / device copy bandwidth measured in the same run). Without a usable GPU: the
// CPU backend on scaled-down shapes, reporting token-heads per second.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>

#include "commands.h"
#include "device_buffers.h"
#include "executor.h"
#include "json_writer.h"
#include "oracle_check.h"

extern "C" char** environ;

namespace flashkda::cli {
namespace {

// The FLASHKDA_* variables set for this run (kernel overrides, experiments such as
// FLASHKDA_STATE_WGMMA=1), by name: a result measured under one of them is not the library's
// default, so the table's header and the JSON name them.
std::map<std::string, std::string> flashkda_overrides() {
  std::map<std::string, std::string> set;
  for (char** e = environ; e && *e; ++e) {
    if (std::strncmp(*e, "FLASHKDA_", 9) != 0) continue;
    const char* eq = std::strchr(*e, '=');
    if (eq) set.emplace(std::string(*e, static_cast<size_t>(eq - *e)), std::string(eq + 1));
  }
  return set;
}

// A decode case of docs/benchmark.md: N requests of T tokens as [N, T, H, *] rows (no
// cu_seqlens), their states in a pool of `pool` dtype, updated in place, or with `verify` the
// state after every draft token written to its own slot. Its goal is relative to the floor.
struct DecodeCase {
  StateKind pool = StateKind::kNone;  // kNone: a prefill case
  bool verify = false;
  double goal_x_floor = 0;  // goal_ms = goal_x_floor * floor_ms (the floor measured in the run)
  const char* goal_rule = "";
};

// A serving row of docs/benchmark.md: a prefill case with the features an inference engine uses.
// Its goal is to be within 10% of the plain safe-gate case it derives from (scripts/bench_report.py
// compares the two medians of one run).
struct ServingCase {
  const char* derived_from = nullptr;  // nullptr: not a serving row
  bool pool = false;                   // bf16 pool of 2N slots, shuffled int32 indices, in place
  int64_t checkpoint_every = 0;        // fp32 checkpoints every that many tokens (0: none)
  Gate gate = Gate::kSafe;             // kSoftplus: with Kimi-Linear-like A_log and dt_bias
};

struct BenchCase {
  std::string name;
  std::vector<int64_t> seq_lens;
  int64_t heads;
  double goal_ms;  // docs/benchmark.md's goal on an H200 (0: none); decode: set from the floor
  DecodeCase decode = {};  // none: a prefill case
  ServingCase serving = {};
  bool is_decode() const { return decode.pool != StateKind::kNone; }
  bool is_serving() const { return serving.derived_from != nullptr; }
  bool uses_pool() const { return is_decode() || serving.pool; }
};

std::vector<int64_t> repeat(int64_t count, int64_t length) { return std::vector<int64_t>(count, length); }

const std::vector<BenchCase>& bench_cases() {
  static const std::vector<int64_t> mixed = {1300, 547, 2048, 963, 271, 3063};
  static const DecodeCase d1{StateKind::kF32, false, 1 / 0.85, ">= 85% of copy bandwidth"};
  static const DecodeCase d2{StateKind::kBF16, false, 1 / 0.85, ">= 85% of copy bandwidth"};
  static const DecodeCase d3{StateKind::kF32, false, 3.0, "<= 3x the floor"};
  static const DecodeCase d4{StateKind::kF32, true, 1 / 0.8, ">= 80% of copy bandwidth"};
  static const ServingCase p1_pool{"P1", true}, p3_pool{"P3", true}, p1_ckpt{"P1", true, 1024};
  static const ServingCase p1_softplus{"P1", false, 0, Gate::kSoftplus}, p7_softplus{"P7", false, 0, Gate::kSoftplus};
  static const std::vector<BenchCase> cases = {
      {"P1", {8192}, 96, 0.48},          {"P2", mixed, 96, 0.49},          {"P3", repeat(8, 1024), 96, 0.50},
      {"P4", {8192}, 64, 0.32},          {"P5", mixed, 64, 0.33},          {"P6", repeat(8, 1024), 64, 0.33},
      {"P7", {32768}, 8, 0.30},          {"P8", {65536}, 4, 0.30},         {"P9", repeat(64, 128), 32, 0.22},
      {"P10", repeat(4, 16384), 16, 0.63},  {"P11", {131072}, 8, 0.8},
      {"D1", repeat(256, 1), 32, 0, d1}, {"D2", repeat(256, 1), 32, 0, d2}, {"D3", repeat(32, 1), 32, 0, d3},
      {"D4", repeat(256, 4), 32, 0, d4},
      // The serving rows, not in the default list (softplus and checkpoints run on the GPU's
      // per-token kernel: slow).
      {"P1-pool", {8192}, 96, 0, {}, p1_pool},  {"P3-pool", repeat(8, 1024), 96, 0, {}, p3_pool},
      {"P1-ckpt", {8192}, 96, 0, {}, p1_ckpt},  {"P1-softplus", {8192}, 96, 0, {}, p1_softplus},
      {"P7-softplus", {32768}, 8, 0, {}, p7_softplus},
  };
  return cases;
}

// The names --case accepts for a case list: a case's own, or "serving" for all the serving rows.
std::vector<std::string> expand_case_name(const std::string& name) {
  std::vector<std::string> names;
  for (const BenchCase& c : bench_cases())
    if (c.name == name || (name == "serving" && c.is_serving())) names.push_back(c.name);
  return names;
}

// The case as run on the CPU: prefill lengths / divisor, decode requests / divisor (the tokens
// per request stay), heads capped; checkpoints every interval / divisor tokens, rounded to a
// multiple of 16 (at least 16).
BenchCase scaled_for_cpu(BenchCase c, int64_t divisor, int64_t max_heads) {
  if (c.is_decode()) {
    const auto requests = static_cast<int64_t>(c.seq_lens.size());
    c.seq_lens = repeat(std::max<int64_t>(1, (requests + divisor / 2) / divisor), c.seq_lens[0]);
  } else {
    for (int64_t& L : c.seq_lens) L = std::max<int64_t>(1, (L + divisor / 2) / divisor);
  }
  if (int64_t& every = c.serving.checkpoint_every; every > 0)
    every = std::max<int64_t>(16, (every / divisor + 8) / 16 * 16);
  c.heads = std::min(c.heads, max_heads);
  return c;
}

// The workload of a case; a case's pool holds `index_sets` disjoint sets of slots.
WorkloadSpec case_spec(const BenchCase& c, uint64_t seed, int64_t index_sets) {
  WorkloadSpec spec;
  spec.seq_lens = c.seq_lens;
  spec.heads = c.heads;
  spec.seed = seed;
  if (c.is_decode()) {
    spec.batch_form = true;
    spec.state = c.decode.pool;
    spec.pool.token_states = c.decode.verify;
  }
  if (c.uses_pool()) spec.pool.index_sets = index_sets;  // serving rows: bf16 states, packed as their base
  spec.checkpoint_every = c.serving.checkpoint_every;
  spec.gate = c.serving.gate;
  if (spec.gate == Gate::kSoftplus) {  // Kimi-Linear-like parameters
    spec.A_log_range = {-1.0f, 2.7f};
    spec.dt_bias_range = {-8.0f, 8.0f};
  }
  return spec;
}

// The bytes one decode call touches: its activations and every slot it reads or writes, once (in
// place, a state is read and written in the same bytes).
double call_footprint(const WorkloadSpec& spec) {
  const double bytes = floor_bytes(spec);
  if (spec.pool.token_states) return bytes;
  return bytes - static_cast<double>(shape_of(spec).N) * static_cast<double>(tensor_bytes(spec).slot);
}

// A pool case's index sets: --input-sets when given, else enough that one pass over them touches
// 3x the L2 (as the prefill rotation), and at least 2, so that no call finds its states in the L2
// from the previous ones (D3: 3 on a 60 MB L2; the serving rows: 2, a pool of 2N slots). Without a
// GPU (l2_bytes 0): 2.
int64_t pool_index_sets(const BenchCase& c, double l2_bytes, int input_sets) {
  if (input_sets > 0) return input_sets;
  const double per_call = call_footprint(case_spec(c, 0, 1));
  return static_cast<int64_t>(std::clamp(std::ceil(3.0 * l2_bytes / per_call), 2.0, 1024.0));
}

constexpr double kCpuTargetTokenHeadsPerS = 100000.0;  // issue 2: the CPU backend on the 2-core machine

struct CaseResult {
  BenchCase c;               // as run (scaled down on the CPU)
  WorkloadSpec spec;         // its workload
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
    std::printf("%-11s %-28s %4s %9s %9s %9s %7s %9s %8s %7s %9s %9s %s\n", "case", "seq_lens", "H", "median_ms",
                "min_ms", "max_ms", "TB/s", "floor_ms", "x_floor", "goal", "err_out", "err_state", "check");
  else
    std::printf("%-11s %-28s %4s %9s %9s %9s %16s %9s %9s %s\n", "case", "seq_lens (scaled)", "H", "median_ms",
                "min_ms", "max_ms", "token-heads/s", "err_out", "err_state", "check");
}

void print_row(const CaseResult& r, bool gpu) {
  const std::string check = !r.error.empty() ? "ERROR" : r.pass() ? "PASS" : "FAIL";
  const std::string err_out = r.check.heads.empty() ? "-" : fmt("%.2e", r.check.out_rel);
  const std::string err_state = r.check.heads.empty() || !r.check.has_final_state ? "-" : fmt("%.2e", r.check.final_state_rel);
  if (gpu)
    std::printf("%-11s %-28s %4lld %9s %9s %9s %7s %9s %8s %7s %9s %9s %s\n", r.c.name.c_str(),
                short_sequences(r.c.seq_lens).c_str(), static_cast<long long>(r.c.heads),
                fmt("%.4f", r.exec.ms.median).c_str(), fmt("%.4f", r.exec.ms.min).c_str(),
                fmt("%.4f", r.exec.ms.max).c_str(), fmt("%.2f", r.tbps).c_str(), fmt("%.4f", r.floor_ms).c_str(),
                fmt("%.2f", r.ratio_to_floor).c_str(), r.c.goal_ms > 0 ? fmt("%.2f", r.c.goal_ms).c_str() : "-",
                err_out.c_str(), err_state.c_str(), check.c_str());
  else
    std::printf("%-11s %-28s %4lld %9s %9s %9s %16s %9s %9s %s\n", r.c.name.c_str(),
                short_sequences(r.c.seq_lens).c_str(), static_cast<long long>(r.c.heads),
                fmt("%.3f", r.exec.ms.median).c_str(), fmt("%.3f", r.exec.ms.min).c_str(),
                fmt("%.3f", r.exec.ms.max).c_str(), format_count(r.token_heads_per_s).c_str(), err_out.c_str(),
                err_state.c_str(), check.c_str());
  if (!r.error.empty()) std::printf("       error: %s\n", r.error.c_str());
  std::fflush(stdout);
}

// What err_state compares with the oracle.
std::string states_checked(const WorkloadSpec& spec) {
  if (!spec.pool.enabled()) return "final state";
  if (spec.pool.token_states)
    return "the first call's token states: the state after token t against the oracle's on the first t + 1 tokens";
  std::string text = "the first call's written slots (the final states, in place)";
  if (spec.checkpoint_every > 0)
    text += " and a middle and the last checkpoint of each sequence, against the oracle's final state on that prefix";
  return text;
}

// A decode case's pool and goal.
Json decode_json(const CaseResult& r) {
  const Shape s = shape_of(r.spec);
  Json d;
  d["requests"] = s.N;
  d["tokens"] = s.T;
  d["pool_dtype"] = state_kind_name(r.spec.state);
  d["pool_slots"] = s.pool_slots;
  d["index_sets"] = r.spec.pool.index_sets;
  d["index_dtype"] = "int32";
  d["token_states"] = r.spec.pool.token_states;
  d["in_place"] = !r.spec.pool.token_states;
  d["goal_rule"] = r.c.decode.goal_rule;
  d["goal_x_floor"] = r.c.decode.goal_x_floor;
  return d;
}

// A serving row's features (its shape and floor are those of the case it derives from).
Json serving_json(const CaseResult& r) {
  Json s;
  s["pool"] = r.spec.pool.enabled();
  s["checkpoints"] = shape_of(r.spec).checkpoints;
  if (r.spec.checkpoint_every > 0) s["checkpoint_every"] = r.spec.checkpoint_every;
  s["gate"] = r.spec.gate == Gate::kSoftplus ? "softplus" : "safe";
  return s;
}

Json case_json(const CaseResult& r, bool gpu) {
  Json j;
  j["name"] = r.c.name;
  j["seq_lens"] = r.c.seq_lens;
  j["heads"] = r.c.heads;
  if (r.c.is_decode()) j["decode"] = decode_json(r);
  if (r.c.is_serving()) {
    j["derived_from"] = r.c.serving.derived_from;
    j["serving"] = serving_json(r);
  }
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
  oracle["states"] = states_checked(r.spec);
  if (r.check.heads.empty()) {
    oracle["skipped"] = true;
  } else {
    oracle["out_rel"] = r.check.out_rel;
    oracle["final_state_rel"] = r.check.final_state_rel;
    if (!r.check.checkpoint_columns.empty()) {
      oracle["checkpoints_checked"] = r.check.checkpoint_columns;
      oracle["checkpoint_rel"] = r.check.checkpoint_rel;
    }
    oracle["bar"] = kErrorBar;
  }
  oracle["pass"] = r.check.pass();
  j["oracle"] = std::move(oracle);
  j["pass"] = r.pass();
  return j;
}

// The states of a case, for --list.
std::string case_states(const BenchCase& c) {
  if (c.is_serving()) {
    const ServingCase& s = c.serving;
    std::string text = std::string("as ") + s.derived_from;
    if (s.pool) text += ", bf16 pool of 2N slots, in place";
    if (s.checkpoint_every) text += ", fp32 checkpoints every " + std::to_string(s.checkpoint_every) + " tokens";
    if (s.gate == Gate::kSoftplus) text += ", softplus gate";
    return text + "; serving row, only with --case";
  }
  if (!c.is_decode()) return "bf16 in and out";
  return std::string(state_kind_name(c.decode.pool)) + " pool" +
         (c.decode.verify ? ", every draft token's state to its own slot" : ", in place") + "; goal " +
         c.decode.goal_rule;
}

// What every case of a run shares.
struct RunContext {
  bool gpu = false, scaled = false;
  int64_t cpu_divisor = 16, cpu_max_heads = 8;
  uint64_t seed = 0;
  int oracle_heads = 2, input_sets = 0;
  double copy_bandwidth = NAN, l2_bytes = 0;
  ExecSettings settings;
};

// The floor, the effective bandwidth and the goal, from the median and the copy bandwidth.
void rate(CaseResult& r, const RunContext& ctx) {
  const double seconds = r.exec.ms.median * 1e-3;
  r.token_heads_per_s = r.token_heads / seconds;
  if (!ctx.gpu) return;
  r.tbps = r.bytes / seconds / 1e12;
  r.floor_ms = r.bytes / ctx.copy_bandwidth * 1e3;
  r.ratio_to_floor = r.exec.ms.median / r.floor_ms;
  if (r.c.is_decode()) r.c.goal_ms = r.c.decode.goal_x_floor * r.floor_ms;
}

// Runs case `index` (1-based) of `count`: inputs, timed calls, oracle check. A flashkda::Error or
// a failed host allocation becomes the case's error.
CaseResult run_case(const BenchCase& original, const RunContext& ctx, int index, size_t count) {
  CaseResult r;
  r.c = ctx.scaled ? scaled_for_cpu(original, ctx.cpu_divisor, ctx.cpu_max_heads) : original;
  r.original_seq_lens = original.seq_lens;
  r.original_heads = original.heads;
  const int64_t index_sets = r.c.uses_pool() ? pool_index_sets(r.c, ctx.l2_bytes, ctx.input_sets) : 0;
  r.spec = case_spec(r.c, ctx.seed + static_cast<uint64_t>(index), index_sets);
  const WorkloadSpec& spec = r.spec;
  const Shape shape = shape_of(spec);
  r.total_tokens = shape.total_tokens;
  r.token_heads = static_cast<double>(shape.total_tokens) * static_cast<double>(shape.H);
  r.bytes = floor_bytes(spec);
  ExecSettings settings = ctx.settings;
  settings.label = "bench " + r.c.name + " " + std::to_string(index) + "/" + std::to_string(count);
  try {
    // A built-in case too large for this host's memory is reported as that case's error.
    if (std::string shortfall = host_memory_shortfall(spec, ctx.oracle_heads, ctx.gpu); !shortfall.empty())
      throw HostAllocError(shortfall);
    std::cerr << "[" << settings.label << "] " << describe_sequences(spec.seq_lens) << " x " << spec.heads
              << " heads" << (spec.pool.enabled() ? ", a pool of " + std::to_string(shape.pool_slots) + " slots" : "")
              << ": generating inputs" << std::endl;
    set_activity("generating the random inputs");
    const HostInputs inputs = make_host_inputs(spec);
    set_activity("running the forward calls");
    r.exec = execute(inputs, settings);
    const std::vector<int64_t> heads = pick_heads(shape.H, ctx.oracle_heads);
    if (!heads.empty())
      std::cerr << "[" << settings.label << "] fp64 oracle on " << heads.size() << " head(s)" << std::endl;
    set_activity("checking against the fp64 oracle");
    r.check = check_against_oracle(inputs, r.exec.out.data(),
                                   r.exec.final_state.empty() ? nullptr : r.exec.final_state.data(), heads,
                                   r.exec.checkpoint_state.empty() ? nullptr : r.exec.checkpoint_state.data());
    rate(r, ctx);
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
  r.exec.checkpoint_state = {};
  return r;
}

// The method block of the decode cases (docs/benchmark.md, "Decode and verify cases").
Json decode_method_json() {
  Json d;
  d["inputs"] = "q, k, v, g, beta [N, T, H, 128] bf16, one row per request, no cu_seqlens";
  d["pool"] = "one pool [P, H, 128, 128] of the case's dtype (D1, D3, D4 fp32; D2 bf16) holding index_sets disjoint "
              "sets of slots, shuffled; P = index_sets x N, and index_sets x N x (T + 1) for D4; int32 indices";
  d["in_place"] = "D1-D3: initial_state == final_state == the pool, state_indices [N] (distinct slots)";
  d["verify"] = "D4: token_state_indices [N, T], the state after every draft token to its own slot, all distinct "
                "and distinct from the start slots (read only); no final state written";
  d["rotation"] = "call i uses index set i % index_sets and its own copy of the activations and out; index_sets: "
                  "enough that one pass touches 3x the L2 (a call's activations and slots, each once), at least 2, "
                  "so no call finds its states in the L2";
  d["index_check"] = "the first call validates the index arrays (SeqlenCheck::kHost); the timed calls skip the "
                     "host copy (SeqlenCheck::kDeviceGuardsOnly, what an engine capturing CUDA graphs gets)";
  d["written_check"] = "before the timed calls the pool is restored as generated and out and the token-state "
                       "slots are poisoned; afterwards no poison is left and every (slot, head) state written in "
                       "place differs from its value before the timed calls";
  d["oracle"] = "the first call, on the pool as generated: out and the slots it wrote; D4: the state after token t "
                "against the oracle's final state on the first t + 1 tokens, all tokens in final_state_rel";
  d["floor_bytes"] = "N*H*128*128*s*2 + N*T*H*(128*2*5 + 2), s = 4 for an fp32 pool, 2 for bf16";
  d["floor_bytes_verify"] = "N*H*128*128*s*(1 + T) + N*T*H*(128*2*5 + 2) (D4: one state written per draft token)";
  d["goals"] = {{"D1", "goal_ms = floor_ms / 0.85"},
                {"D2", "goal_ms = floor_ms / 0.85"},
                {"D3", "goal_ms = 3 * floor_ms"},
                {"D4", "goal_ms = floor_ms / 0.8"}};
  return d;
}

// The method block of the serving rows (docs/benchmark.md, "Serving rows").
Json serving_method_json() {
  Json s;
  s["shapes"] = "those of the case each derives from (derived_from): the same seq_lens, heads, packed int64 "
                "cu_seqlens, bf16 states, floor formula";
  s["pool"] = "P1-pool, P3-pool, P1-ckpt: the bf16 states in one pool [2N, H, 128, 128] (two index sets of N "
              "shuffled slots, int32 state_indices), updated in place; validated once, timed with "
              "SeqlenCheck::kDeviceGuardsOnly; out and the written slots checked against the oracle";
  s["checkpoints"] = "P1-ckpt: checkpoint_offsets [N, C] int32 every 1024 tokens, checkpoint_state [N, C, H, 128, "
                     "128] fp32; the floor adds N*C*H*128*128*4; a middle and the last checkpoint checked against "
                     "the oracle's final state on that prefix";
  s["softplus"] = "P1-softplus, P7-softplus: gate softplus, A_log ~ U(-1, 2.7), dt_bias ~ U(-8, 8)";
  s["goal"] = "median within 10% of the median of the case it derives from, in the same run";
  return s;
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
                    "Benchmarks KDA forward on the prefill cases P1-P11 of docs/benchmark.md (K = V = 128, bf16\n"
                    "inputs, bf16 initial and final state, safe gate with lower_bound -5, packed int64 cu_seqlens,\n"
                    "random inputs), the decode cases D1-D4 (32 heads, [N, T] rows, states in an fp32 or bf16\n"
                    "pool updated in place through int32 indices; D4 writes every draft token's state to its own\n"
                    "slot), the serving rows (P1 or P3 from a bf16 state pool, P1 with fp32 checkpoints, P1 or P7\n"
                    "with the softplus gate; only with --case), or a custom shape. Prints a table and writes JSON.\n"
                    "\n"
                    "GPU method: inputs rotate among enough device copies that one pass exceeds 3x the L2 (decode:\n"
                    "one pool, disjoint index sets of slots); outputs are poisoned (0xFF) before the timed calls\n"
                    "and checked written after; warm-up; median of CUDA-event timings of single forward calls; the\n"
                    "floor is the bytes of docs/benchmark.md's formula over the device-to-device copy bandwidth\n"
                    "measured in the same run.\n"
                    "Without a usable GPU (or with --backend cpu) the CPU backend runs scaled-down shapes\n"
                    "(sequence lengths, or decode requests, / 16, heads capped at 8) and reports token-heads per\n"
                    "second.");
  parser.add("--case", "P1,D1,...",
             "cases to run (default: all of P1-P11 and D1-D4); 'serving': the serving rows\n"
             "P1-pool, P3-pool, P1-ckpt, P1-softplus, P7-softplus, which run only when named",
             [&](const std::string& v) {
               for (const std::string& name : split(v, ',')) {
                 const std::vector<std::string> names = expand_case_name(name);
                 if (names.empty())
                   throw UsageError("--case: expected case names P1..P11 or D1..D4, serving rows (P1-pool, ...) "
                                    "or 'serving' (comma-separated), got '" + name + "'");
                 case_names.insert(case_names.end(), names.begin(), names.end());
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
  parser.add("--input-sets", "N",
             "GPU: device copies of the inputs to rotate, or a pool case's index sets\n"
             "(default: enough for 3x the L2, at least 2)",
             [&](const std::string& v) { input_sets = static_cast<int>(parse_int("--input-sets", v, 1, 1024)); });
  parser.add("--cpu-divisor", "D", "CPU: divide each case's sequence lengths (decode: requests) by D (default 16)",
             [&](const std::string& v) { cpu_divisor = parse_int("--cpu-divisor", v, 1, 1 << 20); });
  parser.add("--cpu-max-heads", "H", "CPU: cap each case's heads at H (default 8)",
             [&](const std::string& v) { cpu_max_heads = parse_int("--cpu-max-heads", v, 1, 4096); });
  add_common_flags(parser, flags);
  parser.set_epilog(std::string(exit_codes_help()) +
                    "\nexamples:\n"
                    "  flashkda bench\n"
                    "  flashkda bench --case P7,P8 --json p7p8.json\n"
                    "  flashkda bench --case D1,D2,D3,D4\n"
                    "  flashkda bench --case P1,P3,P7,serving\n"
                    "  flashkda bench --seqlens 4096,4096 --heads 32\n");
  if (!parser.parse(argc, argv, first)) return kExitOk;

  if (list) {
    std::printf("%-11s %-36s %4s %s\n", "case", "seq_lens", "H", "states");
    for (const BenchCase& c : bench_cases())
      std::printf("%-11s %-36s %4lld %s\n", c.name.c_str(), short_sequences(c.seq_lens).c_str(),
                  static_cast<long long>(c.heads), case_states(c).c_str());
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
    for (const BenchCase& c : bench_cases())
      if (case_names.empty() ? !c.is_serving()
                             : std::find(case_names.begin(), case_names.end(), c.name) != case_names.end())
        cases.push_back(c);
  }
  const bool scaled = !gpu && !flags.shape_given();

  std::printf("flashkda %s bench, commit %s\n", version(), commit.c_str());
  const std::map<std::string, std::string> overrides = flashkda_overrides();
  if (!overrides.empty()) {
    std::printf("overrides:");
    for (const auto& [name, value] : overrides) std::printf(" %s=%s", name.c_str(), value.c_str());
    std::printf(" (not the library's default choices)\n");
  }
  RunContext ctx;
  ctx.gpu = gpu;
  ctx.scaled = scaled;
  ctx.cpu_divisor = cpu_divisor;
  ctx.cpu_max_heads = cpu_max_heads;
  ctx.seed = flags.seed;
  ctx.oracle_heads = oracle_heads;
  ctx.input_sets = input_sets;
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
    ctx.copy_bandwidth = copy_bandwidth;
    ctx.l2_bytes = static_cast<double>(device_l2_bytes());
  } else {
    std::printf("device: none used: CPU backend (%s)\n", why_cpu.c_str());
    if (scaled)
      std::printf("NOTE: CPU run on SCALED-DOWN shapes (sequence lengths, or decode requests, / %lld, heads capped\n"
                  "      at %lld); the times are not comparable with the GPU figures of docs/benchmark.md. Throughput\n"
                  "      is in token-heads per second.\n",
                  static_cast<long long>(cpu_divisor), static_cast<long long>(cpu_max_heads));
  }
  std::printf("\n");
  print_header(gpu);

  ExecSettings& settings = ctx.settings;
  settings.backend = backend;
  settings.iters = iters.value_or(gpu ? 30 : 10);
  settings.warmup = warmup.value_or(gpu ? 10 : 2);
  settings.input_sets = input_sets;
  settings.progress = true;

  std::vector<CaseResult> results;
  for (size_t i = 0; i < cases.size(); ++i) {
    results.push_back(run_case(cases[i], ctx, static_cast<int>(i + 1), cases.size()));
    print_row(results.back(), gpu);
  }

  // Throughput over the prefill cases that ran: total token-heads over total median time. The
  // decode cases move a whole state per token-head, so the CPU target (a prefill figure) leaves
  // them out.
  double total_token_heads = 0, total_seconds = 0, slowest = INFINITY;
  std::string slowest_case;
  bool all_pass = true, any_error = false;
  for (const CaseResult& r : results) {
    all_pass &= r.pass();
    any_error |= !r.error.empty();
    if (!r.error.empty() || r.c.is_decode()) continue;
    total_token_heads += r.token_heads;
    total_seconds += r.exec.ms.median * 1e-3;
    if (r.token_heads_per_s < slowest) slowest = r.token_heads_per_s, slowest_case = r.c.name;
  }
  const double aggregate = total_seconds > 0 ? total_token_heads / total_seconds : NAN;
  const bool any_prefill = total_seconds > 0;
  std::printf("\n");
  if (!gpu && any_prefill) {
    std::printf("CPU throughput: %s token-heads/s over the prefill cases (slowest case %s: %s token-heads/s); "
                "target >= %s: %s\n",
                format_count(aggregate).c_str(), slowest_case.c_str(), format_count(slowest).c_str(),
                format_count(kCpuTargetTokenHeadsPerS).c_str(),
                aggregate >= kCpuTargetTokenHeadsPerS ? (slowest >= kCpuTargetTokenHeadsPerS ? "met, every case" : "met overall, not by every case")
                                                      : "NOT met");
  } else if (!gpu) {
    std::printf("CPU throughput: no prefill case ran (the target of %s token-heads/s is for prefill)\n",
                format_count(kCpuTargetTokenHeadsPerS).c_str());
  }

  Json j;
  j["tool"] = "flashkda bench";
  j["version"] = version();
  j["commit"] = commit;
  j["overrides"] = Json::object();
  for (const auto& [name, value] : overrides) j["overrides"][name] = value;
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
    j["scale_note"] = "CPU backend on scaled-down shapes: sequence lengths (decode: requests) / " +
                      std::to_string(cpu_divisor) + ", heads capped at " + std::to_string(cpu_max_heads) +
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
  if (std::any_of(cases.begin(), cases.end(), [](const BenchCase& c) { return c.is_decode(); }))
    method["decode"] = decode_method_json();
  if (std::any_of(cases.begin(), cases.end(), [](const BenchCase& c) { return c.is_serving(); }))
    method["serving"] = serving_method_json();
  method["seed"] = flags.seed;
  j["method"] = std::move(method);
  Json case_list = Json::array();
  for (const CaseResult& r : results) case_list.push_back(case_json(r, gpu));
  j["cases"] = std::move(case_list);
  j["token_heads_per_s_overall"] = aggregate;  // the prefill cases'
  if (!gpu && any_prefill) {
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
