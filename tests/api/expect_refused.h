// EXPECT_REFUSED(problem, args, code, matchers...): forward() on host tensors refuses `args` with
// `code` and a message matching every matcher, writes nothing, and the C ABI says the same.
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
