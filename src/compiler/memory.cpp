#include "sharc/compiler/memory.h"

#include <algorithm>
#include <map>

#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

// Bytes the runtime allocates for one gather node: its parameters' buffers
// (kept ones excepted: they are resident already) and, for a bucket, the
// staging buffer until the wait. A kept parameter is gathered again once a
// step (its shard changed), through the bucket's staging like the others,
// so the staging counts every member.
struct GatherBytes {
  int64_t buffers = 0;
  int64_t staging = 0;
};

GatherBytes gather_bytes(const Graph& graph, const Node& gather) {
  GatherBytes out;
  int64_t members = 0;
  for (int64_t p : gather.params) {
    const Param& param = graph.params.at(p);
    members += param.bytes;
    if (!param.kept) out.buffers += param.bytes;
  }
  if (gather.params.size() > 1) out.staging = members;
  return out;
}

}  // namespace

int64_t kept_bytes(const Graph& graph) {
  int64_t total = 0;
  for (const auto& [id, p] : graph.params) {
    if (p.kept) total += p.bytes;
  }
  return total;
}

GatheredPeak peak_gathered(const Graph& graph) {
  std::vector<size_t> order(graph.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  return peak_gathered(graph, order);
}

GatheredPeak peak_gathered(const Graph& graph, const std::vector<size_t>& order) {
  int64_t live = kept_bytes(graph);
  GatheredPeak peak{live, 0};
  std::map<std::string, int64_t> staging;  // gather value -> its staging bytes
  for (size_t i = 0; i < order.size(); ++i) {
    const Node& n = graph.nodes.at(order[i]);
    if (n.kind == NodeKind::Gather) {
      const GatherBytes b = gather_bytes(graph, n);
      live += b.buffers + b.staging;
      if (b.staging > 0 && !n.outputs.empty()) staging[n.outputs[0]] += b.staging;
    } else if (n.kind == NodeKind::Wait && !n.operands.empty()) {
      auto it = staging.find(n.operands[0].value);
      if (it != staging.end()) {
        live -= it->second;
        staging.erase(it);
      }
    } else if (n.kind == NodeKind::Release) {
      for (int64_t p : n.params) {
        const Param& param = graph.params.at(p);
        if (!param.kept) live -= param.bytes;
      }
    }
    if (live > peak.bytes) peak = {live, i};
  }
  return peak;
}

std::string describe(const Graph& graph, const GatheredPeak& peak) {
  if (graph.nodes.empty()) return detail::concat(peak.bytes, " bytes gathered (kept)");
  return detail::concat(peak.bytes, " bytes gathered after node ", peak.node, " (",
                        to_string(graph.nodes[peak.node].kind), ")");
}

}  // namespace sharc::ir
