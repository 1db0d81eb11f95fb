// The C ABI (flashkda_c.h): error codes, flashkda_last_error(), NULL arguments, and a valid call
// after a refused one. Host tensors only (the CPU backend).
#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "host_args.h"

namespace flashkda::api_test {
namespace {

using ::testing::HasSubstr;

TEST(CApi, ValidCallReturnsOkAndClearsTheLastError) {
  HostProblem p;
  const flashkda_forward_args c = to_c(p.args());
  size_t bytes = 123;
  EXPECT_EQ(flashkda_forward_workspace_size(&c, &bytes), FLASHKDA_OK);
  EXPECT_EQ(bytes, 0u);  // host tensors: the CPU backend needs no workspace
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_OK);
  EXPECT_STREQ(flashkda_last_error(), "");
  EXPECT_FALSE(p.out.all_equal(0xAB));
}

TEST(CApi, InvalidArgumentReturnsItsCodeAndMessage) {
  HostProblem p;
  flashkda_forward_args c = to_c(p.args());
  c.beta.dtype = FLASHKDA_F32;
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), ::testing::AllOf(HasSubstr("beta:"), HasSubstr("expected dtype bfloat16"),
                                                      HasSubstr("got float32")));
  EXPECT_TRUE(p.outputs_untouched());
}

TEST(CApi, UnsupportedReturnsItsCode) {
  HostSetup s;
  s.K = 64;
  HostProblem p(s);
  const flashkda_forward_args c = to_c(p.args());
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_ERR_UNSUPPORTED);
  EXPECT_THAT(flashkda_last_error(), ::testing::AllOf(HasSubstr("q:"), HasSubstr("K must be 128"), HasSubstr("got K = 64")));
  size_t bytes = 0;
  EXPECT_EQ(flashkda_forward_workspace_size(&c, &bytes), FLASHKDA_ERR_UNSUPPORTED);
}

TEST(CApi, CuSeqlensValuesAreCheckedThroughTheCAbi) {
  HostSetup s;
  s.cu_seqlens = {0, 17, 39};
  HostProblem p(s);
  const flashkda_forward_args c = to_c(p.args());
  EXPECT_EQ(flashkda_forward(&c, nullptr, 0, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), ::testing::AllOf(HasSubstr("cu_seqlens:"), HasSubstr("T = 40"), HasSubstr("got 39")));
  EXPECT_TRUE(p.outputs_untouched());
}

TEST(CApi, NullArgs) {
  EXPECT_EQ(flashkda_forward(nullptr, nullptr, 0, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), HasSubstr("args"));
  size_t bytes = 0;
  EXPECT_EQ(flashkda_forward_workspace_size(nullptr, &bytes), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), HasSubstr("args"));
  HostProblem p;
  const flashkda_forward_args c = to_c(p.args());
  EXPECT_EQ(flashkda_forward_workspace_size(&c, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), HasSubstr("bytes"));
}

TEST(CApi, ValidCallAfterARefusedOneWorks) {
  HostProblem p;
  flashkda_forward_args good = to_c(p.args());
  ASSERT_EQ(flashkda_forward(&good, nullptr, 0, nullptr), FLASHKDA_OK);
  const std::string expected(reinterpret_cast<const char*>(p.out.data()), p.out.size());

  flashkda_forward_args bad = good;
  bad.lower_bound = 0.5f;
  EXPECT_EQ(flashkda_forward(&bad, nullptr, 0, nullptr), FLASHKDA_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(flashkda_last_error(), HasSubstr("lower_bound:"));

  p.poison_outputs();
  EXPECT_EQ(flashkda_forward(&good, nullptr, 0, nullptr), FLASHKDA_OK);
  EXPECT_STREQ(flashkda_last_error(), "");
  EXPECT_EQ(0, std::memcmp(p.out.data(), expected.data(), expected.size()));
}

TEST(CApi, VersionMatchesTheCppApi) { EXPECT_STREQ(flashkda_version(), flashkda::version()); }

}  // namespace
}  // namespace flashkda::api_test
