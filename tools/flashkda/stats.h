// Summary statistics of repeated timings.
#pragma once

#include <algorithm>
#include <vector>

namespace flashkda::cli {

struct TimingStats {
  double median = 0, min = 0, max = 0;
  int count = 0;
};

inline TimingStats summarize(std::vector<double> samples) {
  TimingStats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  s.count = static_cast<int>(n);
  s.min = samples.front();
  s.max = samples.back();
  s.median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return s;
}

}  // namespace flashkda::cli
