// run_forward() on the CPU backend: forward() itself (host tensors, no workspace).
#include "common/run_forward.h"

namespace flashkda::testing {

void run_forward(const ForwardArgs& a) { forward(a, nullptr, 0); }

const char* backend_under_test() { return "cpu"; }

}  // namespace flashkda::testing
