#pragma once
// How many parameter bytes a schedule holds gathered at once.
//
// The model, as the runtime allocates: a `kept` parameter's bytes are
// resident for the whole graph (it stays gathered across graphs); any other
// parameter counts its bytes from the gather that serves it to its release;
// a gather serving two or more parameters (a bucket) also holds a staging
// buffer of their total bytes, kept ones included (they are gathered again
// once a step), from the gather until its wait, where the runtime copies
// the bucket out into each parameter's buffer. Direct
// parameter reads (`@k` operands, before insert_gather_release) count
// nothing: only gathers allocate.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sharc/compiler/ir.h"

namespace sharc::ir {

struct GatheredPeak {
  int64_t bytes = 0;  ///< the most bytes gathered at once
  size_t node = 0;    ///< the first node after which that many are gathered
};

/// The peak of gathered bytes over `graph`'s schedule (see above).
GatheredPeak peak_gathered(const Graph& graph);

/// The same, were the nodes run in `order` (indices into graph.nodes, each
/// once): what a pass weighing a move asks, without building the moved
/// graph. The peak's `node` is a position in `order`.
GatheredPeak peak_gathered(const Graph& graph, const std::vector<size_t>& order);

/// Bytes of the graph's `kept` parameters (resident throughout).
int64_t kept_bytes(const Graph& graph);

/// A one-line account of a peak for messages, e.g.
/// "12288 bytes gathered after node 7 (wait)".
std::string describe(const Graph& graph, const GatheredPeak& peak);

}  // namespace sharc::ir
