// What the refusal suites share: EXPECT_REFUSED(problem, args, code, matchers...) (forward() on
// host tensors refuses `args` with `code` and a message matching every matcher, writes nothing,
// and the C ABI says the same) and a fixture holding a valid problem to break.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "host_args.h"

#define EXPECT_REFUSED(problem, args, expected_code, ...)                                         \
  do {                                                                                            \
    const Refusal r_ = refuse(problem, args);                                                     \
    ASSERT_TRUE(r_.thrown) << "forward accepted the arguments";                                   \
    EXPECT_EQ(r_.code, expected_code) << r_.message;                                              \
    EXPECT_THAT(r_.message, ::testing::AllOf(__VA_ARGS__));                                       \
    EXPECT_TRUE(r_.outputs_untouched) << "outputs were written although the call was refused";   \
    EXPECT_EQ(r_.c_code, static_cast<int>(expected_code)) << "C ABI: " << r_.c_message;           \
    EXPECT_EQ(r_.c_message, r_.message) << "the C ABI's flashkda_last_error() differs";           \
  } while (0)

namespace flashkda::api_test {

constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;

// A valid problem whose arguments a test breaks one at a time.
class HostArgsTest : public ::testing::Test {
 protected:
  HostProblem p;  // 2 packed sequences [17, 23], T = 40, H = 2, K = V = 128, bf16 states
  ForwardArgs a = p.args();
};

}  // namespace flashkda::api_test
