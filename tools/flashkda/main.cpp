// flashkda: the command-line tool. `flashkda run` is the main job, `flashkda bench` the
// benchmark; see `flashkda --help`.
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "commands.h"
#include "device_buffers.h"

namespace {

const char* kUsage =
    "usage: flashkda <command> [flags]\n"
    "\n"
    "FlashKDA: Kimi Delta Attention forward (prefill) kernels for Hopper GPUs, with a CPU backend.\n"
    "\n"
    "commands:\n"
    "  run      the main job: KDA forward on a Kimi-Linear-like prefill, checked against the fp64 oracle\n"
    "  bench    the benchmark cases P1-P11 and D1-D4 (scaled down on the CPU), as a table and JSON\n"
    "  info     version, commit, and whether the CUDA path can run here\n"
    "\n"
    "`flashkda <command> --help` documents every flag of a command.\n"
    "  --help     print this help\n"
    "  --version  print the version and commit\n";

int info() {
  using namespace flashkda;
  std::printf("flashkda %s (commit %s)\n", version(), cli::build_commit());
  std::printf("CUDA kernels compiled: %s\n", cuda_compiled() ? "yes" : "no");
  std::printf("CUDA devices: %d\n", cuda_device_count());
  std::string why;
  if (cli::cuda_available(&why))
    std::printf("device: %s\nrun/bench backend: cuda\n", cuda_device_name().c_str());
  else
    std::printf("run/bench backend: cpu (%s)\n", why.c_str());
  return cli::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashkda::cli;
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  const std::string command = argv[1];
  try {
    if (command == "--help" || command == "-h" || command == "help") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
    if (command == "--version") {
      std::printf("flashkda %s (commit %s)\n", flashkda::version(), build_commit());
      return kExitOk;
    }
    if (command == "run") return run_command(argc, argv, 2);
    if (command == "bench") return bench_command(argc, argv, 2);
    if (command == "info") {
      if (argc > 2 && std::strcmp(argv[2], "--help") != 0)
        throw UsageError("flashkda info: takes no flags, got '" + std::string(argv[2]) + "'");
      if (argc > 2) {
        std::puts("usage: flashkda info\n\nPrints the version, the commit, and whether the CUDA path can run here.");
        return kExitOk;
      }
      return info();
    }
    throw UsageError("flashkda: unknown command '" + command + "' (commands: run, bench, info; see flashkda --help)");
  } catch (const UsageError& e) {
    const std::string message = e.what();
    const bool named = message.rfind("flashkda", 0) == 0;
    std::fprintf(stderr, "%s%s%s\n", named ? "" : "flashkda ", named ? "" : (command + ": ").c_str(), message.c_str());
    return kExitUsage;
  } catch (const flashkda::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "flashkda: error: %s\n", e.what());
    return kExitError;
  } catch (const std::bad_alloc&) {
    // Large host buffers name themselves (HostAllocError); this is any other allocation.
    std::fflush(stdout);
    std::fprintf(stderr, "flashkda: error: out of host memory (std::bad_alloc) while %s\n", activity());
    return kExitError;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "flashkda: error: %s\n", e.what());
    return kExitError;
  }
}
