// The backend a suite tests: the serving suites (state pools, checkpoints, strided inputs) call
// run_forward() on host tensors, and their binary links one of two definitions:
// run_forward_host.cpp (forward() on the CPU backend, tests/cpu) or tests/gpu/run_forward_device.cpp
// (the same arguments mirrored to the device, run on the CUDA path and copied back), so one set of
// tests with one set of assertions covers both backends.
#pragma once

#include "flashkda/flashkda.h"

namespace flashkda::testing {

// Runs forward(a) on the backend under test; outputs land in a's host buffers. Throws flashkda::Error
// as forward() does.
void run_forward(const ForwardArgs& a);

// Which backend run_forward() uses, for messages.
const char* backend_under_test();

}  // namespace flashkda::testing
