#pragma once
// Measures what a group's collectives cost, for the scheduler's cost model.

#include <c10/core/Device.h>

#include "sharc/core/collective_cost.h"
#include "sharc/runtime/communicator.h"

namespace sharc {

struct CollectiveCosts {
  CollectiveCost all_gather;
  CollectiveCost reduce_scatter;
};

/// Times an all-gather and a reduce-scatter at a few sizes on `device` (a
/// warm-up, then the median of a few repeats), takes each size's slowest
/// rank (one all-reduce), and fits latency + bytes/bandwidth to each kind.
/// Every rank gets the same numbers, so schedules built from them match.
/// Collective: every rank must call it. A few milliseconds on CPU.
CollectiveCosts measure_collective_costs(Communicator& comm, c10::Device device);

}  // namespace sharc
