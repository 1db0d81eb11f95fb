// fail(): throws flashkda::Error, its message streamed together from the pieces given (which
// argument, what was expected, what was given). A leaf header: only the public error type under
// it, so every layer (validation, the CPU and CUDA backends, the launch code) reports errors the
// same way without depending on api/.
#pragma once

#include <sstream>

#include "flashkda/flashkda.h"

namespace flashkda {

template <typename... Parts>
[[noreturn]] void fail(ErrorCode code, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(code, os.str());
}

}  // namespace flashkda
