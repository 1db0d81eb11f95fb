#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "common/bf16.h"

namespace flashkda::cli {
namespace {

// A counter-based generator: value i of stream `key` is a hash of (key, i), so the inputs do not
// depend on how the work is split across threads.
inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline double uniform_open01(uint64_t key, uint64_t i) {  // in (0, 1)
  return (static_cast<double>(mix64(key ^ mix64(i)) >> 11) + 0.5) * 0x1p-53;
}

uint64_t stream_key(uint64_t seed, uint64_t tensor_id) { return mix64(mix64(seed) + 0x632be59bd9b4e019ull * (tensor_id + 1)); }

// Standard normals by Box-Muller, two per pair of uniforms; store(i, z) writes element i.
template <typename Store>
void fill_normal(int64_t n, uint64_t key, Store store) {
  const int64_t pairs = (n + 1) / 2;
  parallel_for(pairs, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const double r = std::sqrt(-2.0 * std::log(uniform_open01(key, 2 * p)));
      const double t = 6.283185307179586 * uniform_open01(key, 2 * p + 1);
      store(2 * p, r * std::cos(t));
      if (2 * p + 1 < n) store(2 * p + 1, r * std::sin(t));
    }
  });
}

void fill_normal_bf16(HostVector<uint16_t>& x, uint64_t key) {
  uint16_t* data = x.data();
  fill_normal(static_cast<int64_t>(x.size()), key,
              [data](int64_t i, double z) { data[i] = float_to_bf16(static_cast<float>(z)); });
}

void fill_uniform_f32(HostVector<float>& x, uint64_t key, UniformRange range) {
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(range.lo + (static_cast<double>(range.hi) - range.lo) * uniform_open01(key, i));
}

enum TensorId : uint64_t { kQ, kK, kV, kG, kBeta, kALog, kDtBias, kState, kSlots };

// 0, 1, ..., n - 1 in a random order (Fisher-Yates on the counter-based generator).
std::vector<int32_t> shuffled_slots(int64_t n, uint64_t key) {
  std::vector<int32_t> slots(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) slots[i] = static_cast<int32_t>(i);
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t draw = mix64(key ^ mix64(static_cast<uint64_t>(i)));
    const auto j = static_cast<int64_t>(draw % static_cast<uint64_t>(i + 1));
    std::swap(slots[i], slots[j]);
  }
  return slots;
}

// Splits the shuffled pool into the index sets: set i takes slots_per_set consecutive entries,
// the first N as its start slots, the rest (with token states) as its token slots [N, T].
void make_index_sets(HostInputs& in, uint64_t key) {
  const Shape& s = in.shape;
  const std::vector<int32_t> order = shuffled_slots(s.pool_slots, key);
  const int64_t sets = in.spec.pool.index_sets;
  in.state_indices.resize(sets);
  in.token_state_indices.resize(in.spec.pool.token_states ? sets : 0);
  for (int64_t i = 0; i < sets; ++i) {
    const auto first = order.begin() + i * s.slots_per_set;
    in.state_indices[i].assign(first, first + s.N);
    if (in.spec.pool.token_states) in.token_state_indices[i].assign(first + s.N, first + s.slots_per_set);
  }
}

// checkpoint_offsets [N, C]: every `every` tokens of each sequence, -1 past its length.
void make_checkpoint_offsets(HostInputs& in) {
  const Shape& s = in.shape;
  const int64_t every = in.spec.checkpoint_every;
  in.checkpoint_offsets.assign(static_cast<size_t>(s.N * s.checkpoints), -1);
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t c = 0; c < in.spec.seq_lens[n] / every; ++c)
      in.checkpoint_offsets[n * s.checkpoints + c] = static_cast<int32_t>((c + 1) * every);
}

}  // namespace

const char* state_kind_name(StateKind s) {
  switch (s) {
    case StateKind::kNone: return "none";
    case StateKind::kBF16: return "bf16";
    case StateKind::kF32: return "f32";
  }
  return "?";
}

Shape shape_of(const WorkloadSpec& spec) {
  Shape s;
  s.H = spec.heads;
  s.N = static_cast<int64_t>(spec.seq_lens.size());
  if (spec.batch_form) {
    s.B = s.N;
    s.T = s.N ? spec.seq_lens[0] : 0;
    s.packed = false;
  } else {
    s.B = 1;
    s.T = 0;
    for (int64_t L : spec.seq_lens) s.T += L;
    s.packed = true;
  }
  s.total_tokens = s.B * s.T;
  s.state_dtype = spec.state == StateKind::kF32 ? DType::kF32 : DType::kBF16;
  s.written_per_sequence = spec.pool.token_states ? s.T : 1;
  if (spec.pool.enabled()) {
    s.slots_per_set = s.N * (spec.pool.token_states ? s.T + 1 : 1);
    s.pool_slots = spec.pool.index_sets * s.slots_per_set;
  }
  if (spec.checkpoint_every > 0)
    for (int64_t L : spec.seq_lens) s.checkpoints = std::max(s.checkpoints, L / spec.checkpoint_every);
  return s;
}

TensorBytes tensor_bytes(const WorkloadSpec& spec) {
  const Shape s = shape_of(spec);
  const size_t rows = static_cast<size_t>(s.total_tokens) * s.H;
  const size_t state = static_cast<size_t>(s.N) * s.H * s.V * s.K * dtype_size(s.state_dtype);
  TensorBytes b;
  b.q = b.k = b.g = rows * s.K * 2;
  b.v = b.out = rows * s.V * 2;
  b.beta = rows * 2;
  b.A_log = s.H * 4;
  b.dt_bias = s.H * s.K * 4;
  b.initial_state = spec.state == StateKind::kNone ? 0 : state;
  b.final_state = spec.final_state ? state : 0;
  b.cu_seqlens = s.packed ? (s.N + 1) * dtype_size(spec.cu_seqlens_dtype) : 0;
  if (spec.pool.enabled()) {
    b.slot = static_cast<size_t>(s.H) * s.V * s.K * dtype_size(s.state_dtype);
    b.initial_state = static_cast<size_t>(s.pool_slots) * b.slot;
    b.final_state = 0;  // in place, or the token states: slots of the same pool
    b.state_indices = static_cast<size_t>(s.N) * 4;
    b.token_state_indices = spec.pool.token_states ? static_cast<size_t>(s.N) * s.T * 4 : 0;
  }
  b.checkpoint_offsets = static_cast<size_t>(s.N) * s.checkpoints * 4;
  b.checkpoint_state = static_cast<size_t>(s.N) * s.checkpoints * s.H * s.V * s.K * 4;
  return b;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  double scaled = bytes;
  while (scaled >= 1000 && u < 6) scaled /= 1000, ++u;
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f bytes", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.3g bytes (%.3g %s)", bytes, scaled, units[u]);
  return buf;
}

std::string alloc_failure_message(const std::string& what, double bytes) {
  return "out of host memory: cannot allocate " + format_bytes(bytes) + " for " + what;
}

HostMemory host_memory_needed(const WorkloadSpec& spec, int64_t oracle_heads, bool gpu) {
  // In doubles throughout: the token count of a command line can overflow 64 bits once
  // multiplied out.
  double T = 0;
  for (int64_t L : spec.seq_lens) T += static_cast<double>(L);
  const double N = static_cast<double>(spec.seq_lens.size());
  const double H = static_cast<double>(spec.heads), K = kHeadDim, V = kHeadDim;
  const double state_elem = spec.state == StateKind::kF32 ? 4 : 2;
  const double state = N * H * V * K * state_elem;
  // With a pool the input is the whole pool, the CPU works on a copy of it, and the states one
  // call writes (one per token with token states) are copied out for the oracle check.
  const PoolSpec& pool = spec.pool;
  const double per_set = pool.token_states ? N + T : N;  // the batch form: T = N x tokens per sequence
  const double pool_bytes =
      pool.enabled() ? static_cast<double>(pool.index_sets) * per_set * H * V * K * state_elem : 0;
  const double written = pool.token_states ? T * H * V * K * state_elem : state;
  const double checkpoints = static_cast<double>(shape_of(spec).checkpoints) * N * H * V * K * 4;  // fp32
  HostMemory m;
  m.inputs = T * H * (3 * K + V) * 2 + T * H * 2 + H * 4 + H * K * 4 +
             (spec.state == StateKind::kNone ? 0 : pool.enabled() ? pool_bytes : state) + (N + 1) * 8;
  m.outputs = T * H * V * 2 + (spec.final_state ? written : 0) + (pool.enabled() && !gpu ? pool_bytes : 0) + checkpoints;
  m.staging = gpu ? m.outputs : 0;
  const double hs = static_cast<double>(std::clamp<int64_t>(oracle_heads, 0, spec.heads));
  if (hs > 0) {
    // The heads' inputs copied out, then the oracle's out and final state in fp64.
    const double slice_state = spec.state == StateKind::kNone ? 0 : N * hs * V * K * state_elem;
    const double slice = T * hs * ((3 * K + V) * 2 + 2) + slice_state;
    m.oracle = slice + T * hs * V * 8 + (spec.final_state ? N * hs * V * K * 8 : 0);
  }
  return m;
}

double host_memory_available(std::string* source) {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    double kb = 0;
    if (fields >> kb && kb > 0) {
      if (source) *source = "MemAvailable in /proc/meminfo";
      return kb * 1024;
    }
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) {
    if (source) *source = "physical memory";
    return static_cast<double>(pages) * static_cast<double>(page);
  }
  return 0;
}

std::string host_memory_shortfall(const WorkloadSpec& spec, int64_t oracle_heads, bool gpu) {
  const HostMemory m = host_memory_needed(spec, oracle_heads, gpu);
  std::string source;
  const double available = host_memory_available(&source);
  if (available <= 0 || m.total() <= available) return "";
  double T = 0;
  for (int64_t L : spec.seq_lens) T += static_cast<double>(L);
  char tokens[32];
  std::snprintf(tokens, sizeof tokens, "%.0f", T);
  auto short_bytes = [](double bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", bytes);
    return std::string(buf);
  };
  const size_t n = spec.seq_lens.size();
  std::string text = "the workload needs " + format_bytes(m.total()) + " of host memory at its peak (T = " + tokens +
                     " tokens, H = " + std::to_string(spec.heads) + " heads, " + std::to_string(n) +
                     (n == 1 ? " sequence" : " sequences") + "): " + short_bytes(m.inputs) +
                     " for the inputs q, k, v, g, beta";
  if (spec.state != StateKind::kNone) text += " and the initial state";
  text += ", " + short_bytes(m.outputs) + " for out";
  if (spec.final_state) text += " and the final state";
  // The larger of the two that come and go (they add up to the total).
  if (m.oracle > 0 && m.oracle >= m.staging)
    text += ", " + short_bytes(m.oracle) + " for the fp64 oracle check";
  else if (m.staging > 0)
    text += ", " + short_bytes(m.staging) + " for the GPU path's staging copy of the outputs";
  return text + "; " + format_bytes(available) + " are available (" + source + ")";
}

double floor_bytes(const WorkloadSpec& spec) {
  const TensorBytes b = tensor_bytes(spec);
  // The activations read, out and the checkpoints written, each once.
  const double once = static_cast<double>(b.q + b.k + b.v + b.g + b.beta + b.out + b.checkpoint_state);
  if (!spec.pool.enabled()) return once + static_cast<double>(b.initial_state + b.final_state);
  // Each start state read once; written back once in place, or once per token with token states.
  const Shape s = shape_of(spec);
  return once + static_cast<double>(s.N) * static_cast<double>(b.slot) * (1.0 + s.written_per_sequence);
}

HostInputs make_host_inputs(const WorkloadSpec& spec) {
  HostInputs in;
  in.spec = spec;
  in.shape = shape_of(spec);
  const Shape& s = in.shape;
  const size_t rows = static_cast<size_t>(s.total_tokens) * s.H;
  // What each buffer holds, for the message of a failed allocation: "the input q ([1, 500, 8, 128] bf16)".
  auto label = [](const char* name, const std::vector<int64_t>& dims, const char* dtype) {
    return std::string(name) + " ([" + join(dims) + "] " + dtype + ")";
  };
  resize_or_throw(in.q, rows * s.K, label("the input q", {s.B, s.T, s.H, s.K}, "bf16"));
  resize_or_throw(in.k, rows * s.K, label("the input k", {s.B, s.T, s.H, s.K}, "bf16"));
  resize_or_throw(in.g, rows * s.K, label("the input g", {s.B, s.T, s.H, s.K}, "bf16"));
  resize_or_throw(in.v, rows * s.V, label("the input v", {s.B, s.T, s.H, s.V}, "bf16"));
  resize_or_throw(in.beta, rows, label("the input beta", {s.B, s.T, s.H}, "bf16"));
  resize_or_throw(in.A_log, s.H, label("the input A_log", {s.H}, "f32"));
  resize_or_throw(in.dt_bias, s.H * s.K, label("the input dt_bias", {s.H, s.K}, "f32"));
  fill_normal_bf16(in.q, stream_key(spec.seed, kQ));
  fill_normal_bf16(in.k, stream_key(spec.seed, kK));
  fill_normal_bf16(in.v, stream_key(spec.seed, kV));
  fill_normal_bf16(in.g, stream_key(spec.seed, kG));
  fill_normal_bf16(in.beta, stream_key(spec.seed, kBeta));
  fill_uniform_f32(in.A_log, stream_key(spec.seed, kALog), spec.A_log_range);
  fill_uniform_f32(in.dt_bias, stream_key(spec.seed, kDtBias), spec.dt_bias_range);

  if (spec.state != StateKind::kNone) {
    const int64_t states = spec.pool.enabled() ? s.pool_slots : s.N;
    const int64_t n = states * s.H * s.V * s.K;
    resize_or_throw(in.initial_state, n * dtype_size(s.state_dtype),
                    label(spec.pool.enabled() ? "the state pool" : "the initial state", {states, s.H, s.V, s.K},
                          state_kind_name(spec.state)));
    const uint64_t key = stream_key(spec.seed, kState);
    if (s.state_dtype == DType::kF32) {
      auto* data = reinterpret_cast<float*>(in.initial_state.data());
      fill_normal(n, key, [data](int64_t i, double z) { data[i] = static_cast<float>(z); });
    } else {
      auto* data = reinterpret_cast<uint16_t*>(in.initial_state.data());
      fill_normal(n, key, [data](int64_t i, double z) { data[i] = float_to_bf16(static_cast<float>(z)); });
    }
  }

  if (s.packed) {
    resize_or_throw(in.cu_seqlens, (s.N + 1) * dtype_size(spec.cu_seqlens_dtype),
                    label("cu_seqlens", {s.N + 1}, dtype_name(spec.cu_seqlens_dtype)));
    int64_t offset = 0;
    for (int64_t n = 0; n <= s.N; ++n) {
      if (spec.cu_seqlens_dtype == DType::kI32) {
        const int32_t v = static_cast<int32_t>(offset);
        std::memcpy(in.cu_seqlens.data() + n * 4, &v, 4);
      } else {
        std::memcpy(in.cu_seqlens.data() + n * 8, &offset, 8);
      }
      if (n < s.N) offset += spec.seq_lens[n];
    }
  }
  if (spec.pool.enabled()) make_index_sets(in, stream_key(spec.seed, kSlots));
  if (s.checkpoints > 0) make_checkpoint_offsets(in);
  return in;
}

const HostVector<int32_t>& HostInputs::written_slots(int64_t set) const {
  static const HostVector<int32_t> none;
  if (!spec.pool.enabled()) return none;
  return spec.pool.token_states ? token_state_indices[set] : state_indices[set];
}

HostVector<unsigned char> gather_slots(const unsigned char* pool, const HostVector<int32_t>& slots, size_t slot_bytes) {
  HostVector<unsigned char> packed;
  resize_or_throw(packed, slots.size() * slot_bytes, "the copy of " + std::to_string(slots.size()) + " pool slots");
  for (size_t i = 0; i < slots.size(); ++i)
    std::memcpy(packed.data() + i * slot_bytes, pool + static_cast<size_t>(slots[i]) * slot_bytes, slot_bytes);
  return packed;
}

TensorPointers host_input_pointers(const HostInputs& in, int64_t set) {
  TensorPointers p;
  p.q = in.q.data();
  p.k = in.k.data();
  p.v = in.v.data();
  p.g = in.g.data();
  p.beta = in.beta.data();
  p.A_log = in.A_log.data();
  p.dt_bias = in.dt_bias.data();
  p.initial_state = in.initial_state.empty() ? nullptr : in.initial_state.data();
  p.cu_seqlens = in.cu_seqlens.empty() ? nullptr : in.cu_seqlens.data();
  if (in.spec.pool.enabled()) {
    p.state_indices = in.state_indices[set].data();
    p.token_state_indices = in.spec.pool.token_states ? in.token_state_indices[set].data() : nullptr;
  }
  p.checkpoint_offsets = in.checkpoint_offsets.empty() ? nullptr : in.checkpoint_offsets.data();
  return p;
}

ForwardArgs make_forward_args(const WorkloadSpec& spec, const TensorPointers& p) {
  const Shape s = shape_of(spec);
  ForwardArgs a;
  a.q = make_tensor(p.q, DType::kBF16, s.B, s.T, s.H, s.K);
  a.k = make_tensor(p.k, DType::kBF16, s.B, s.T, s.H, s.K);
  a.v = make_tensor(p.v, DType::kBF16, s.B, s.T, s.H, s.V);
  a.g = make_tensor(p.g, DType::kBF16, s.B, s.T, s.H, s.K);
  a.beta = make_tensor(p.beta, DType::kBF16, s.B, s.T, s.H);
  a.A_log = make_tensor(p.A_log, DType::kF32, s.H);
  a.dt_bias = make_tensor(p.dt_bias, DType::kF32, s.H, s.K);
  const int64_t states = spec.pool.enabled() ? s.pool_slots : s.N;  // a pool, or one state per sequence
  if (spec.state != StateKind::kNone && p.initial_state)
    a.initial_state = make_tensor(p.initial_state, s.state_dtype, states, s.H, s.V, s.K);
  if (s.packed) a.cu_seqlens = make_tensor(p.cu_seqlens, spec.cu_seqlens_dtype, s.N + 1);
  a.out = make_tensor(p.out, DType::kBF16, s.B, s.T, s.H, s.V);
  if (spec.final_state && p.final_state)
    a.final_state = make_tensor(p.final_state, s.state_dtype, states, s.H, s.V, s.K);
  if (spec.pool.enabled()) {
    a.state_indices = make_tensor(p.state_indices, DType::kI32, s.N);
    if (spec.pool.token_states) a.token_state_indices = make_tensor(p.token_state_indices, DType::kI32, s.N, s.T);
  }
  if (s.checkpoints > 0) {
    a.checkpoint_offsets = make_tensor(p.checkpoint_offsets, DType::kI32, s.N, s.checkpoints);
    a.checkpoint_state = make_tensor(p.checkpoint_state, DType::kF32, s.N, s.checkpoints, s.H, s.V, s.K);
  }
  a.lower_bound = spec.lower_bound;
  a.scale = spec.scale;
  a.gate = spec.gate;
  return a;
}

std::string join(const std::vector<int64_t>& values, const char* sep) {
  std::string s;
  for (size_t i = 0; i < values.size(); ++i) s += (i ? sep : "") + std::to_string(values[i]);
  return s;
}

std::string describe_sequences(const std::vector<int64_t>& seq_lens) {
  int64_t total = 0;
  for (int64_t L : seq_lens) total += L;
  const size_t n = seq_lens.size();
  std::string list;
  const bool all_equal = n > 1 && std::all_of(seq_lens.begin(), seq_lens.end(), [&](int64_t L) { return L == seq_lens[0]; });
  if (all_equal)
    return std::to_string(n) + " sequences of " + std::to_string(seq_lens[0]) +
           (seq_lens[0] == 1 ? " token (" : " tokens (") + std::to_string(total) + " tokens)";
  else if (n <= 12)
    list = std::string("[") + join(seq_lens) + "]";
  else
    list = std::string("[") + std::to_string(seq_lens[0]) + ", " + std::to_string(seq_lens[1]) + ", ..., " +
           std::to_string(seq_lens[n - 1]) + "]";
  return std::to_string(n) + (n == 1 ? " sequence " : " sequences ") + list + " (" + std::to_string(total) +
         " tokens)";
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinPerThread = 1 << 14;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::clamp<int64_t>(n / kMinPerThread, 1, hw);
  if (threads == 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * per, end = std::min(n, begin + per);
    if (begin < end) pool.emplace_back(fn, begin, end);
  }
  for (auto& th : pool) th.join();
}

}  // namespace flashkda::cli
