#pragma once
// A predicted run of a schedule, from the costs in the IR.
//
// The model: one thread of computation runs the nodes in order, each compute
// node taking its `cost=` (microseconds; 0 where none was measured); the
// collectives run one at a time, in the order they are issued, on one
// channel beside it: a gather or reduce_scatter starts when it is issued
// and the channel is free, and takes its collective's predicted time
// (CollectiveCost over the bytes it moves: a gather's parameters that are
// not kept, a reduction's gradients); a wait or wait_reduce holds the
// computation until its collective is done. Releases, inputs and the output
// take no time.
//
// The prediction orders decisions; it does not promise times: costs are
// measured node by node (an upper bound on fused kernels), and on a CPU the
// channel shares the cores with the computation.

#include <cstddef>
#include <optional>
#include <vector>

#include "sharc/compiler/ir.h"
#include "sharc/core/collective_cost.h"

namespace sharc::ir {

/// The measured costs of a group's two collectives; unset: not measured.
struct CollectiveCostModel {
  std::optional<CollectiveCost> gather;
  std::optional<CollectiveCost> reduce;
};

struct Timeline {
  /// When each node starts, by index: what the computation has reached
  /// (for a gather: when it is issued).
  std::vector<double> start_us;
  /// For each collective (gather, reduce_scatter) by index, when the channel
  /// finishes it; 0 for other nodes.
  std::vector<double> done_us;
  double end_us = 0.0;      ///< when the last node ends
  double exposed_us = 0.0;  ///< time the computation spends held in waits
};

/// Predicts `graph`'s run (see above). A collective whose cost is unset
/// takes no time. Throws sharc::Error if a wait names no collective.
Timeline predict(const Graph& graph, const CollectiveCostModel& costs);

/// Whether some compute node of `graph` carries a measured cost: without
/// one a prediction says nothing about overlap.
bool has_compute_costs(const Graph& graph);

/// Bytes a gather moves (its parameters that are not kept).
int64_t gathered_bytes(const Graph& graph, const Node& gather);

}  // namespace sharc::ir
