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
  for (int i = 0; i < settings.iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    forward(args, nullptr, 0);
    const auto stop = std::chrono::steady_clock::now();
    r.samples_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  r.ms = summarize(r.samples_ms);
  const Shape s = shape_of(in.spec);
  r.unwritten_out = count_poisoned(r.out.data(), bytes.out, DType::kBF16);
  r.unwritten_final_state = count_poisoned(r.final_state.data(), bytes.final_state, s.state_dtype);
  return r;
}

// Byte offsets of each tensor inside one device allocation holding a whole input set.
struct SetLayout {
  size_t q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, inputs_total;
  size_t out, final_state, outputs_total;
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
  l.inputs_total = std::max<size_t>(c, 256);
  c = 0;
  l.out = place(c, b.out), l.final_state = place(c, b.final_state);
  l.outputs_total = std::max<size_t>(c, 256);
  return l;
}

struct DeviceSet {
  DeviceBuffer inputs, outputs;
  ForwardArgs args;
};

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
  std::vector<DeviceSet> device(sets);
  for (DeviceSet& d : device) {
    d.inputs = DeviceBuffer(layout.inputs_total);
    d.outputs = DeviceBuffer(layout.outputs_total);
    copy_to_device(d.inputs.bytes_at(layout.q), in.q.data(), bytes.q);
    copy_to_device(d.inputs.bytes_at(layout.k), in.k.data(), bytes.k);
    copy_to_device(d.inputs.bytes_at(layout.v), in.v.data(), bytes.v);
    copy_to_device(d.inputs.bytes_at(layout.g), in.g.data(), bytes.g);
    copy_to_device(d.inputs.bytes_at(layout.beta), in.beta.data(), bytes.beta);
    copy_to_device(d.inputs.bytes_at(layout.A_log), in.A_log.data(), bytes.A_log);
    copy_to_device(d.inputs.bytes_at(layout.dt_bias), in.dt_bias.data(), bytes.dt_bias);
    copy_to_device(d.inputs.bytes_at(layout.initial_state), in.initial_state.data(), bytes.initial_state);
    copy_to_device(d.inputs.bytes_at(layout.cu_seqlens), in.cu_seqlens.data(), bytes.cu_seqlens);
    TensorPointers p;
    p.q = d.inputs.bytes_at(layout.q), p.k = d.inputs.bytes_at(layout.k);
    p.v = d.inputs.bytes_at(layout.v), p.g = d.inputs.bytes_at(layout.g);
    p.beta = d.inputs.bytes_at(layout.beta), p.A_log = d.inputs.bytes_at(layout.A_log);
    p.dt_bias = d.inputs.bytes_at(layout.dt_bias);
    p.initial_state = bytes.initial_state ? d.inputs.bytes_at(layout.initial_state) : nullptr;
    p.cu_seqlens = bytes.cu_seqlens ? d.inputs.bytes_at(layout.cu_seqlens) : nullptr;
    p.out = d.outputs.bytes_at(layout.out);
    p.final_state = bytes.final_state ? d.outputs.bytes_at(layout.final_state) : nullptr;
    d.args = make_forward_args(in.spec, p);
  }

  ExecResult r;
  r.input_sets = sets;
  Stream stream;
  r.workspace_bytes = forward_workspace_size(device[0].args);
  DeviceBuffer workspace(r.workspace_bytes);

  // The first call validates cu_seqlens on the host (a synchronisation); the rest, timed, skip
  // that check, since these inputs were checked once and do not change.
  forward(device[0].args, workspace.data(), workspace.size(), stream.get());
  stream.synchronize();
  auto call = [&](int i) {
    ForwardArgs args = device[i % sets].args;
    args.seqlen_check = SeqlenCheck::kDeviceGuardsOnly;
    forward(args, workspace.data(), workspace.size(), stream.get());
  };
  for (int i = 0; i < settings.warmup; ++i) call(i);
  stream.synchronize();
  for (const DeviceSet& d : device) fill_device(d.outputs.data(), 0xFF, d.outputs.size());

  progress(settings, "timing " + std::to_string(settings.iters) + " calls with CUDA events");
  EventTimings timings(settings.iters);
  for (int i = 0; i < settings.iters; ++i) {
    timings.start(i, stream.get());
    call(i);
    timings.stop(i, stream.get());
  }
  stream.synchronize();
  r.samples_ms = timings.elapsed_ms();
  r.ms = summarize(r.samples_ms);

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

}  // namespace

ExecResult execute(const HostInputs& in, const ExecSettings& settings) {
  return settings.backend == Backend::kCuda ? execute_cuda(in, settings) : execute_cpu(in, settings);
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
