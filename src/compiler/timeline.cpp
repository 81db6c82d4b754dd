#include "sharc/compiler/timeline.h"

#include <algorithm>
#include <map>
#include <string>

#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

double collective_us(const std::optional<CollectiveCost>& cost, int64_t bytes) {
  return cost && bytes > 0 ? cost->time_us(bytes) : 0.0;
}

// Bytes of the values a reduction reads: the gradients compute nodes made.
int64_t reduced_bytes(const Node& reduction, const std::map<std::string, int64_t>& bytes_of) {
  int64_t total = 0;
  for (const Operand& o : reduction.operands) {
    auto it = bytes_of.find(o.value);
    if (it != bytes_of.end()) total += it->second;
  }
  return total;
}

}  // namespace

int64_t gathered_bytes(const Graph& graph, const Node& gather) {
  int64_t total = 0;
  for (int64_t p : gather.params) {
    const Param& param = graph.params.at(p);
    if (!param.kept) total += param.bytes;
  }
  return total;
}

bool has_compute_costs(const Graph& graph) {
  return std::any_of(graph.nodes.begin(), graph.nodes.end(), [](const Node& n) {
    return n.kind == NodeKind::Compute && n.cost.has_value();
  });
}

Timeline predict(const Graph& graph, const CollectiveCostModel& costs) {
  Timeline line;
  line.start_us.resize(graph.nodes.size());
  line.done_us.assign(graph.nodes.size(), 0.0);
  std::map<std::string, int64_t> bytes_of;  // compute outputs
  std::map<std::string, double> done_at;    // collective token -> when it finishes
  double now = 0.0, channel_free = 0.0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& n = graph.nodes[i];
    line.start_us[i] = now;
    switch (n.kind) {
      case NodeKind::Compute:
        now += std::max(0.0, n.cost.value_or(0.0));
        for (const std::string& v : n.outputs) bytes_of[v] = n.bytes;
        break;
      case NodeKind::Gather:
      case NodeKind::ReduceScatter: {
        const double took =
            n.kind == NodeKind::Gather
                ? collective_us(costs.gather, gathered_bytes(graph, n))
                : collective_us(costs.reduce, reduced_bytes(n, bytes_of));
        channel_free = std::max(now, channel_free) + took;
        line.done_us[i] = channel_free;
        if (!n.outputs.empty()) done_at[n.outputs[0]] = channel_free;
        break;
      }
      case NodeKind::Wait:
      case NodeKind::WaitReduce: {
        SHARC_CHECK(!n.operands.empty() && done_at.count(n.operands[0].value),
                    "sharc ir: node ", i, " (", to_string(n.kind),
                    ") waits on no collective issued before it");
        const double ready = done_at.at(n.operands[0].value);
        if (ready > now) {
          line.exposed_us += ready - now;
          now = ready;
        }
        break;
      }
      case NodeKind::AllReduce:  // the replicate link is not modelled: its reduction's end
        if (!n.operands.empty() && !n.outputs.empty() && done_at.count(n.operands[0].value)) {
          done_at[n.outputs[0]] = done_at.at(n.operands[0].value);
        }
        break;
      default:
        break;
    }
  }
  line.end_us = now;
  return line;
}

}  // namespace sharc::ir
