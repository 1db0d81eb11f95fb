// The commit the tool was built from, recorded at build time by commit_header.cmake.
#include "commands.h"
#include "flashkda_commit.h"

namespace flashkda::cli {

const char* build_commit() { return FLASHKDA_GIT_COMMIT; }

}  // namespace flashkda::cli
