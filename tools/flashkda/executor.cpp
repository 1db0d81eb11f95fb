#include "executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>

#include "device_buffers.h"
#include "oracle_check.h"

namespace flashkda::cli {
namespace {

void progress(const ExecSettings& s, const std::string& message) {
  if (s.progress) std::cerr << "[" << s.label << "] " << message << std::endl;
}

std::string megabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

TimingStats time_cpu_calls(const std::vector<ForwardArgs>& args, int iters, std::vector<double>& samples) {
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    forward(args[i % args.size()], nullptr, 0);
    const auto stop = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return summarize(samples);
}

ExecResult execute_cpu(const HostInputs& in, const ExecSettings& settings) {
  const TensorBytes bytes = tensor_bytes(in.spec);
  ExecResult r;
  resize_or_throw(r.out, bytes.out / 2, "the output out");
  resize_or_throw(r.final_state, bytes.final_state, "the final state");
  TensorPointers p = host_input_pointers(in);
  p.out = r.out.data();
  p.final_state = r.final_state.empty() ? nullptr : r.final_state.data();
  const ForwardArgs args = make_forward_args(in.spec, p);
  r.workspace_bytes = forward_workspace_size(args);

  forward(args, nullptr, 0);  // validates everything, cu_seqlens included
  for (int i = 0; i < settings.warmup; ++i) forward(args, nullptr, 0);
  std::memset(r.out.data(), 0xFF, bytes.out);
  std::memset(r.final_state.data(), 0xFF, bytes.final_state);
  progress(settings, "timing " + std::to_string(settings.iters) + " calls on the CPU");
  r.ms = time_cpu_calls({args}, settings.iters, r.samples_ms);
  const Shape s = shape_of(in.spec);
  r.unwritten_out = count_poisoned(r.out.data(), bytes.out, DType::kBF16);
  r.unwritten_final_state = count_poisoned(r.final_state.data(), bytes.final_state, s.state_dtype);
  return r;
}

// Elements of the states that one set's calls wrote (`after`, packed as written_slots(set)) that
// show no write in the timed calls: still poisoned (token states), or, in place, inside a (slot,
// head) state bit for bit as generated (the pool was restored to that before the timed calls).
int64_t unwritten_states(const HostInputs& in, int64_t set, const HostVector<unsigned char>& after) {
  const Shape s = shape_of(in.spec);
  if (in.spec.pool.token_states) return count_poisoned(after.data(), after.size(), s.state_dtype);
  const size_t state_bytes = static_cast<size_t>(s.V) * s.K * dtype_size(s.state_dtype);
  const HostVector<unsigned char> before = gather_slots(in.initial_state.data(), in.written_slots(set),
                                                        state_bytes * s.H);
  int64_t unchanged = 0;
  for (size_t at = 0; at < after.size(); at += state_bytes)
    if (std::memcmp(after.data() + at, before.data() + at, state_bytes) == 0) unchanged += s.V * s.K;
  return unchanged;
}

// Decode from a pool on the CPU: one working copy of the pool, updated in place by every call.
ExecResult execute_cpu_pool(const HostInputs& in, const ExecSettings& settings) {
  const TensorBytes bytes = tensor_bytes(in.spec);
  const int64_t sets = in.spec.pool.index_sets;
  ExecResult r;
  r.input_sets = static_cast<int>(sets);
  HostVector<unsigned char> pool;
  HostVector<uint16_t> out;
  HostVector<float> checkpoints;
  resize_or_throw(pool, bytes.initial_state, "the working copy of the state pool");
  resize_or_throw(out, bytes.out / 2, "the output out");
  resize_or_throw(checkpoints, bytes.checkpoint_state / 4, "the checkpoint states");
  std::vector<ForwardArgs> args;
  for (int64_t set = 0; set < sets; ++set) {
    TensorPointers p = host_input_pointers(in, set);
    p.initial_state = p.final_state = pool.data();  // in place
    p.out = out.data();
    p.checkpoint_state = checkpoints.data();
    args.push_back(make_forward_args(in.spec, p));
  }
  r.workspace_bytes = forward_workspace_size(args[0]);

  // The first call, on the pool as generated, validates everything and is the one checked.
  std::copy(in.initial_state.begin(), in.initial_state.end(), pool.begin());
  forward(args[0], nullptr, 0);
  r.out = out;
  r.checkpoint_state = checkpoints;
  r.final_state = gather_slots(pool.data(), in.written_slots(0), bytes.slot);
  for (int i = 0; i < settings.warmup; ++i) forward(args[(i + 1) % sets], nullptr, 0);

  std::copy(in.initial_state.begin(), in.initial_state.end(), pool.begin());
  std::memset(out.data(), 0xFF, bytes.out);
  std::memset(checkpoints.data(), 0xFF, bytes.checkpoint_state);
  if (in.spec.pool.token_states)
    for (int64_t set = 0; set < sets; ++set)
      for (int32_t slot : in.written_slots(set)) std::memset(pool.data() + slot * bytes.slot, 0xFF, bytes.slot);
  progress(settings, "timing " + std::to_string(settings.iters) + " calls on the CPU, " + std::to_string(sets) +
                         " index sets over one pool");
  r.ms = time_cpu_calls(args, settings.iters, r.samples_ms);
  r.sets_checked = static_cast<int>(std::min<int64_t>(sets, settings.iters));
  r.unwritten_out = count_poisoned(out.data(), bytes.out, DType::kBF16);
  r.unwritten_checkpoints = count_poisoned(checkpoints.data(), bytes.checkpoint_state, DType::kF32);
  for (int set = 0; set < r.sets_checked; ++set)
    r.unwritten_final_state += unwritten_states(in, set, gather_slots(pool.data(), in.written_slots(set), bytes.slot));
  return r;
}

// Byte offsets of each tensor inside one device allocation holding a whole input set.
struct SetLayout {
  size_t q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices, token_state_indices,
      checkpoint_offsets, inputs_total;
  size_t out, final_state, checkpoint_state, outputs_total;
};

SetLayout layout_of(const TensorBytes& b) {
  auto place = [](size_t& cursor, size_t size) {
    const size_t at = cursor;
    cursor += (size + 255) / 256 * 256;
    return at;
  };
  SetLayout l{};
  size_t c = 0;
  l.q = place(c, b.q), l.k = place(c, b.k), l.v = place(c, b.v), l.g = place(c, b.g);
  l.beta = place(c, b.beta), l.A_log = place(c, b.A_log), l.dt_bias = place(c, b.dt_bias);
  l.initial_state = place(c, b.initial_state), l.cu_seqlens = place(c, b.cu_seqlens);
  l.state_indices = place(c, b.state_indices), l.token_state_indices = place(c, b.token_state_indices);
  l.checkpoint_offsets = place(c, b.checkpoint_offsets);
  l.inputs_total = std::max<size_t>(c, 256);
  c = 0;
  l.out = place(c, b.out), l.final_state = place(c, b.final_state), l.checkpoint_state = place(c, b.checkpoint_state);
  l.outputs_total = std::max<size_t>(c, 256);
  return l;
}

struct DeviceSet {
  DeviceBuffer inputs, outputs;
  ForwardArgs args;
};

// Input set `set` on the device: its inputs and outputs, and the arguments of a call on them.
// With a pool (`pool` not null) the states are that shared pool, in place, and `b` the bytes of
// one set (no states).
DeviceSet upload_set(const HostInputs& in, int64_t set, const TensorBytes& b, const SetLayout& l, void* pool) {
  DeviceSet d;
  d.inputs = DeviceBuffer(l.inputs_total);
  d.outputs = DeviceBuffer(l.outputs_total);
  const TensorPointers host = host_input_pointers(in, set);
  TensorPointers p;
  auto upload = [&](size_t offset, const void* src, size_t bytes) -> const void* {
    copy_to_device(d.inputs.bytes_at(offset), src, bytes);
    return d.inputs.bytes_at(offset);
  };
  // The optional tensors are not given when empty.
  auto upload_optional = [&](size_t offset, const void* src, size_t bytes) {
    return bytes ? upload(offset, src, bytes) : nullptr;
  };
  p.q = upload(l.q, host.q, b.q), p.k = upload(l.k, host.k, b.k);
  p.v = upload(l.v, host.v, b.v), p.g = upload(l.g, host.g, b.g);
  p.beta = upload(l.beta, host.beta, b.beta), p.A_log = upload(l.A_log, host.A_log, b.A_log);
  p.dt_bias = upload(l.dt_bias, host.dt_bias, b.dt_bias);
  p.initial_state = upload_optional(l.initial_state, host.initial_state, b.initial_state);
  p.cu_seqlens = upload_optional(l.cu_seqlens, host.cu_seqlens, b.cu_seqlens);
  p.state_indices = upload_optional(l.state_indices, host.state_indices, b.state_indices);
  p.token_state_indices = upload_optional(l.token_state_indices, host.token_state_indices, b.token_state_indices);
  p.checkpoint_offsets = upload_optional(l.checkpoint_offsets, host.checkpoint_offsets, b.checkpoint_offsets);
  p.out = d.outputs.bytes_at(l.out);
  p.final_state = b.final_state ? d.outputs.bytes_at(l.final_state) : nullptr;
  p.checkpoint_state = b.checkpoint_state ? d.outputs.bytes_at(l.checkpoint_state) : nullptr;
  if (pool) p.initial_state = p.final_state = pool;
  d.args = make_forward_args(in.spec, p);
  return d;
}

// Throws when `bytes` of device memory (beside the workspace) would leave less than 30% free.
void check_device_memory(double bytes, const std::string& what) {
  const size_t free_bytes = device_free_bytes();
  if (bytes > 0.7 * static_cast<double>(free_bytes))
    throw Error(ErrorCode::kCudaError, "the workload needs " + megabytes(bytes) + " of device memory for " + what +
                                           ", " + megabytes(free_bytes) + " are free");
}

// A call on set i % sets that skips the host check of the device index arrays (SeqlenCheck::
// kDeviceGuardsOnly, what an engine capturing CUDA graphs gets): they were validated once.
void call_unchecked(const std::vector<DeviceSet>& device, int i, const DeviceBuffer& workspace, const Stream& stream) {
  ForwardArgs args = device[i % device.size()].args;
  args.seqlen_check = SeqlenCheck::kDeviceGuardsOnly;
  forward(args, workspace.data(), workspace.size(), stream.get());
}

// `iters` calls, each bracketed by its own pair of CUDA events; call i uses set (i + first) % sets.
TimingStats time_device_calls(const std::vector<DeviceSet>& device, int iters, int first, const DeviceBuffer& workspace,
                              const Stream& stream, std::vector<double>& samples) {
  EventTimings timings(iters);
  for (int i = 0; i < iters; ++i) {
    timings.start(i, stream.get());
    call_unchecked(device, i + first, workspace, stream);
    timings.stop(i, stream.get());
  }
  stream.synchronize();
  samples = timings.elapsed_ms();
  return summarize(samples);
}

ExecResult execute_cuda(const HostInputs& in, const ExecSettings& settings) {
  const TensorBytes bytes = tensor_bytes(in.spec);
  const SetLayout layout = layout_of(bytes);
  const Shape shape = shape_of(in.spec);
  const size_t per_set = layout.inputs_total + layout.outputs_total;

  int sets = settings.input_sets;
  if (sets <= 0) {
    const double rotation = 3.0 * static_cast<double>(device_l2_bytes());
    // At least two sets, so that even a call larger than the L2 never starts on the data the
    // previous call left in it.
    sets = static_cast<int>(std::clamp<double>(std::ceil(rotation / static_cast<double>(per_set)), 2.0, 1024.0));
  }
  // Keep 30% of free memory (and the workspace) out of the rotation.
  const size_t free_bytes = device_free_bytes();
  const size_t affordable = static_cast<size_t>(0.7 * static_cast<double>(free_bytes)) / per_set;
  if (affordable < 1)
    throw Error(ErrorCode::kCudaError, "the workload needs " + megabytes(per_set) + " of device memory, " +
                                           megabytes(free_bytes) + " are free");
  sets = static_cast<int>(std::min<size_t>(sets, affordable));

  progress(settings, "uploading " + std::to_string(sets) + " input set(s) of " + megabytes(per_set));
  std::vector<DeviceSet> device;
  for (int i = 0; i < sets; ++i) device.push_back(upload_set(in, 0, bytes, layout, nullptr));

  ExecResult r;
  r.input_sets = sets;
  Stream stream;
  r.workspace_bytes = forward_workspace_size(device[0].args);
  DeviceBuffer workspace(r.workspace_bytes);

  // The first call validates cu_seqlens on the host (a synchronisation); the rest, timed, skip
  // that check, since these inputs were checked once and do not change.
  forward(device[0].args, workspace.data(), workspace.size(), stream.get());
  stream.synchronize();
  for (int i = 0; i < settings.warmup; ++i) call_unchecked(device, i, workspace, stream);
  stream.synchronize();
  for (const DeviceSet& d : device) fill_device(d.outputs.data(), 0xFF, d.outputs.size());

  progress(settings, "timing " + std::to_string(settings.iters) + " calls with CUDA events");
  r.ms = time_device_calls(device, settings.iters, 0, workspace, stream, r.samples_ms);

  // Every set the timed calls used must have been written completely.
  r.sets_checked = std::min(sets, settings.iters);
  HostVector<uint16_t> out;
  HostVector<unsigned char> final_state;
  resize_or_throw(out, bytes.out / 2, "the host copy of out");
  resize_or_throw(final_state, bytes.final_state, "the host copy of the final state");
  for (int i = 0; i < r.sets_checked; ++i) {
    copy_to_host(out.data(), device[i].outputs.bytes_at(layout.out), bytes.out);
    copy_to_host(final_state.data(), device[i].outputs.bytes_at(layout.final_state), bytes.final_state);
    r.unwritten_out += count_poisoned(out.data(), bytes.out, DType::kBF16);
    r.unwritten_final_state += count_poisoned(final_state.data(), bytes.final_state, shape.state_dtype);
    if (i == 0) {
      resize_or_throw(r.out, out.size(), "the output out kept for the oracle check");
      resize_or_throw(r.final_state, final_state.size(), "the final state kept for the oracle check");
      std::copy(out.begin(), out.end(), r.out.begin());
      std::copy(final_state.begin(), final_state.end(), r.final_state.begin());
    }
  }
  return r;
}

// The slots `slots` of a device pool, packed on the host in that order.
HostVector<unsigned char> copy_slots_to_host(const DeviceBuffer& pool, const HostVector<int32_t>& slots,
                                             size_t slot_bytes) {
  HostVector<unsigned char> packed;
  resize_or_throw(packed, slots.size() * slot_bytes,
                  "the host copy of " + std::to_string(slots.size()) + " pool slots");
  for (size_t i = 0; i < slots.size(); ++i)
    copy_to_host(packed.data() + i * slot_bytes, pool.bytes_at(static_cast<size_t>(slots[i]) * slot_bytes), slot_bytes);
  return packed;
}

// Decode from a pool on the GPU: one device pool shared by all calls; each index set has its own
// copy of the activations, its indices and its out. The pool's index sets were sized to the L2
// when the inputs were made (docs/benchmark.md: one call's states are never in the L2 from the
// previous call).
ExecResult execute_cuda_pool(const HostInputs& in, const ExecSettings& settings) {
  const TensorBytes bytes = tensor_bytes(in.spec);
  TensorBytes per_set_bytes = bytes;
  per_set_bytes.initial_state = 0;  // the pool is shared
  const SetLayout layout = layout_of(per_set_bytes);
  const int sets = static_cast<int>(in.spec.pool.index_sets);
  check_device_memory(static_cast<double>(bytes.initial_state) +
                          sets * static_cast<double>(layout.inputs_total + layout.outputs_total),
                      "the state pool and " + std::to_string(sets) + " index sets");

  progress(settings, "uploading the state pool (" + megabytes(bytes.initial_state) + ") and " + std::to_string(sets) +
                         " index sets");
  DeviceBuffer pool(bytes.initial_state);
  copy_to_device(pool.data(), in.initial_state.data(), bytes.initial_state);
  std::vector<DeviceSet> device;
  for (int i = 0; i < sets; ++i) device.push_back(upload_set(in, i, per_set_bytes, layout, pool.data()));

  ExecResult r;
  r.input_sets = sets;
  Stream stream;
  r.workspace_bytes = forward_workspace_size(device[0].args);
  DeviceBuffer workspace(r.workspace_bytes);

  // The first call, on the pool as generated, validates the index arrays on the host and is the
  // one checked against the oracle.
  forward(device[0].args, workspace.data(), workspace.size(), stream.get());
  stream.synchronize();
  resize_or_throw(r.out, bytes.out / 2, "the output out kept for the oracle check");
  copy_to_host(r.out.data(), device[0].outputs.bytes_at(layout.out), bytes.out);
  resize_or_throw(r.checkpoint_state, bytes.checkpoint_state / 4, "the checkpoints kept for the oracle check");
  copy_to_host(r.checkpoint_state.data(), device[0].outputs.bytes_at(layout.checkpoint_state), bytes.checkpoint_state);
  r.final_state = copy_slots_to_host(pool, in.written_slots(0), bytes.slot);
  for (int i = 0; i < settings.warmup; ++i) call_unchecked(device, i + 1, workspace, stream);
  stream.synchronize();

  // Restore the pool, poison out and the token-state slots, none of which any call reads.
  copy_to_device(pool.data(), in.initial_state.data(), bytes.initial_state);
  for (const DeviceSet& d : device) fill_device(d.outputs.data(), 0xFF, d.outputs.size());
  if (in.spec.pool.token_states)
    for (int set = 0; set < sets; ++set)
      for (int32_t slot : in.written_slots(set)) fill_device(pool.bytes_at(slot * bytes.slot), 0xFF, bytes.slot);

  progress(settings, "timing " + std::to_string(settings.iters) + " calls with CUDA events");
  r.ms = time_device_calls(device, settings.iters, 0, workspace, stream, r.samples_ms);

  r.sets_checked = std::min(sets, settings.iters);
  HostVector<uint16_t> out;
  HostVector<float> checkpoints;
  resize_or_throw(out, bytes.out / 2, "the host copy of out");
  resize_or_throw(checkpoints, bytes.checkpoint_state / 4, "the host copy of the checkpoints");
  for (int i = 0; i < r.sets_checked; ++i) {
    copy_to_host(out.data(), device[i].outputs.bytes_at(layout.out), bytes.out);
    copy_to_host(checkpoints.data(), device[i].outputs.bytes_at(layout.checkpoint_state), bytes.checkpoint_state);
    r.unwritten_out += count_poisoned(out.data(), bytes.out, DType::kBF16);
    r.unwritten_checkpoints += count_poisoned(checkpoints.data(), bytes.checkpoint_state, DType::kF32);
    r.unwritten_final_state += unwritten_states(in, i, copy_slots_to_host(pool, in.written_slots(i), bytes.slot));
  }
  return r;
}

}  // namespace

ExecResult execute(const HostInputs& in, const ExecSettings& settings) {
  const bool pool = in.spec.pool.enabled();
  if (settings.backend == Backend::kCuda) return pool ? execute_cuda_pool(in, settings) : execute_cuda(in, settings);
  return pool ? execute_cpu_pool(in, settings) : execute_cpu(in, settings);
}

Backend resolve_backend(int choice, std::string* why_cpu) {
  if (choice == 1) {  // without touching the CUDA runtime
    if (why_cpu) *why_cpu = "chosen with --backend cpu";
    return Backend::kCpu;
  }
  std::string why;
  const bool cuda = cuda_available(&why);
  if (choice == 2) {
    if (!cuda) throw Error(ErrorCode::kNoDevice, "--backend cuda: the CUDA path cannot run here: " + why);
    return Backend::kCuda;
  }
  if (cuda) return Backend::kCuda;
  if (why_cpu) *why_cpu = why;
  return Backend::kCpu;
}

}  // namespace flashkda::cli
