#include "sharc/runtime/collective_probe.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/ATen.h>

namespace sharc {
namespace {

// Full bytes of the collectives timed: a small, a medium and a large one,
// enough to separate latency from bandwidth. The median of 7 runs each: on
// a busy CPU single runs stall for milliseconds now and then, and with 3
// runs the fitted latency of one group came out ten times another's.
constexpr int64_t kSizes[] = {16 << 10, 256 << 10, 4 << 20};
constexpr int kRepeats = 7;

// Blocks until the work is done, on the host and (for a device) its stream.
void finish(c10d::Work& work, const at::Tensor& out) {
  work.wait();
  if (!out.is_cpu()) out.narrow(0, 0, 1).to(at::kCPU);  // host waits for the stream
}

template <typename Launch>
double median_us(Launch launch) {
  std::vector<double> times;
  for (int i = 0; i <= kRepeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    launch();
    const double us = std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - start).count();
    if (i > 0) times.push_back(us);  // the first is a warm-up
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// One time per size and kind: all-gathers first, then reduce-scatters.
std::vector<double> time_collectives(Communicator& comm, c10::Device device) {
  const int64_t world = comm.world_size();
  const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat).device(device);
  std::vector<double> times;
  for (int64_t bytes : kSizes) {
    const int64_t shard = std::max<int64_t>(1, bytes / 4 / world);
    at::Tensor in = at::zeros({shard}, options);
    at::Tensor out = at::empty({shard * world}, options);
    times.push_back(median_us([&] { finish(*comm.all_gather(out, in), out); }));
  }
  for (int64_t bytes : kSizes) {
    const int64_t shard = std::max<int64_t>(1, bytes / 4 / world);
    at::Tensor in = at::zeros({shard * world}, options);
    at::Tensor out = at::empty({shard}, options);
    times.push_back(median_us([&] { finish(*comm.reduce_scatter_sum(out, in), out); }));
  }
  return times;
}

}  // namespace

CollectiveCosts measure_collective_costs(Communicator& comm, c10::Device device) {
  const std::vector<double> mine = time_collectives(comm, device);
  // The slowest rank's time per size: every rank then fits the same numbers.
  at::Tensor times = at::tensor(mine, at::TensorOptions().dtype(at::kDouble)).to(device);
  comm.all_reduce_max(times)->wait();
  times = times.to(at::kCPU);
  const double* t = times.data_ptr<double>();
  std::vector<std::pair<int64_t, double>> gather, reduce;
  const size_t n = std::size(kSizes);
  for (size_t i = 0; i < n; ++i) {
    gather.emplace_back(kSizes[i], t[i]);
    reduce.emplace_back(kSizes[i], t[n + i]);
  }
  return {CollectiveCost::fit(gather), CollectiveCost::fit(reduce)};
}

}  // namespace sharc
