// Random bad arguments through the C++ API and the C ABI: a valid host problem with one or two
// fields of random tensor arguments (shape, rank, strides, dtype code, pointer, index values) or
// scalars set to boundary values. Every call must end in a flashkda::Error (or succeed); none may
// crash, hang, or write outputs when it refuses. Deterministic (fixed seed). (The library cannot
// see allocation sizes: a view that claims memory its caller does not own is the caller's error,
// so the mutations keep every accepted view inside the test's buffers and their slack.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "api/arguments.h"
#include "host_args.h"

namespace flashkda::api_test {
namespace {

constexpr int64_t kInteresting[] = {0, 1, 2, -1, 3, 16, 17, 40, 128, 129, int64_t{1} << 31, int64_t{1} << 40,
                                    int64_t{1} << 62, std::numeric_limits<int64_t>::max(),
                                    std::numeric_limits<int64_t>::min()};

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  int64_t interesting() { return kInteresting[pick(std::size(kInteresting))]; }
  size_t pick(size_t n) { return static_cast<size_t>(rng_() % n); }

  // One random mutation of `a`; index-like values live in `scratch` (kept alive by the caller).
  std::string mutate(ForwardArgs& a, std::vector<int64_t>& scratch) {
    const TensorArgument& arg = kTensorArguments[pick(kNumTensorArguments)];
    Tensor& t = a.*arg.member;
    const int d = static_cast<int>(pick(kMaxDims));
    switch (pick(8)) {
      case 0:
        t.shape[d] = interesting();
        if (t.ndim == 0) t.ndim = d + 1;
        return std::string(arg.name) + ".shape[" + std::to_string(d) + "]";
      case 1:
        t.ndim = static_cast<int32_t>(pick(8)) - 1;
        return std::string(arg.name) + ".ndim";
      case 2:
        // A strided view may legitimately span any memory its caller owns, which the library cannot
        // see: only strides it must refuse are set on q, k, v, g, beta (negative ones); any stride
        // on the other arguments must be refused, unless it leaves them dense.
        t.strides[d] = arg.strided ? -1 - static_cast<int64_t>(pick(1000)) : interesting();
        return std::string(arg.name) + ".strides[" + std::to_string(d) + "]";
      case 3:
        t.dtype = static_cast<DType>(static_cast<int>(pick(9)) - 1);
        return std::string(arg.name) + ".dtype";
      case 4: {
        const int offsets[] = {1, 2, 4, 8, 16};
        t.data = t.data ? static_cast<unsigned char*>(t.data) + offsets[pick(5)] : nullptr;
        return std::string(arg.name) + ".data+";
      }
      case 5:
        t.data = nullptr;
        return std::string(arg.name) + ".data=null";
      case 6: {  // an index-like tensor of random values: [n] or [n, m] int64
        const int64_t n = static_cast<int64_t>(pick(5)), m = static_cast<int64_t>(pick(5)) + 1;
        scratch.assign(static_cast<size_t>(n * m) + 1, 0);
        for (int64_t& x : scratch) x = pick(3) == 0 ? interesting() : static_cast<int64_t>(pick(50)) - 5;
        t = pick(2) ? make_tensor(scratch.data(), DType::kI64, n) : make_tensor(scratch.data(), DType::kI64, n, m);
        return std::string(arg.name) + "=indices";
      }
      default: {
        const float values[] = {0.0f, -0.0f, 1.0f, -5.0f, -6.0f, std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(), 1e-30f};
        if (pick(2)) a.scale = values[pick(std::size(values))];
        else a.lower_bound = values[pick(std::size(values))];
        a.state_layout = static_cast<StateLayout>(static_cast<int>(pick(3)));
        return "scalars";
      }
    }
  }

 private:
  std::mt19937_64 rng_;
};

TEST(FuzzArgs, RandomBadArgumentsNeverCrashAndNeverWriteWhenRefused) {
  HostProblem problem;
  Fuzzer fuzz(20261201);
  int refused = 0, ran = 0;
  for (int i = 0; i < 3000; ++i) {
    ForwardArgs a = problem.args();
    std::vector<int64_t> scratch1, scratch2;
    std::string what = fuzz.mutate(a, scratch1);
    if (fuzz.pick(2)) what += ", " + fuzz.mutate(a, scratch2);
    if (std::getenv("FLASHKDA_FUZZ_VERBOSE")) std::fprintf(stderr, "%d: %s\n", i, what.c_str());
    const Refusal r = refuse(problem, a);  // C++ API, then the C ABI
    if (r.thrown) {
      ++refused;
      EXPECT_TRUE(r.outputs_untouched) << "refused but wrote outputs: " << what << ": " << r.message;
      EXPECT_EQ(r.c_code, static_cast<int>(r.code)) << what;
      EXPECT_FALSE(r.message.empty()) << what;
    } else {
      ++ran;
    }
  }
  std::printf("  %d refused, %d ran\n", refused, ran);
  EXPECT_GT(refused, 2000);  // nearly every mutation breaks the problem; the check is not vacuous
}

}  // namespace
}  // namespace flashkda::api_test
