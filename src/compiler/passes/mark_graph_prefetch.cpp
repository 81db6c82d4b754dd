#include <optional>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Marks the points where the runtime may start the next compiled graph's
// first gather (see [Note: cross-graph prefetch] in
// src/runtime/runtime_graph_prefetch.cpp): right after this graph's last wait, when it
// will gather nothing more and its tail computation can hide the next
// graph's collective, and right after its last release, when it holds the
// least (the runtime starts the gather at the first point where it fits the
// budget). Both name the graph by its last gather's parameters.
class MarkGraphPrefetch : public Pass {
 public:
  explicit MarkGraphPrefetch(std::optional<int64_t> budget) : budget_(budget) {}

  std::string name() const override { return "mark_graph_prefetch"; }

  // It reads where the gathers, waits and releases finally are.
  Contract contract() const override { return {{Rule::GathersInserted}, {}, {}}; }

  int64_t run(Graph& graph, Analyses&) override {
    std::optional<size_t> last_gather, last_wait, last_release;
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      const NodeKind kind = graph.nodes[i].kind;
      if (kind == NodeKind::PrefetchNext) return 0;  // marked already
      if (kind == NodeKind::Gather) last_gather = i;
      if (kind == NodeKind::Wait) last_wait = i;
      if (kind == NodeKind::Release) last_release = i;
    }
    if (!last_gather || !last_wait) return 0;
    const std::vector<int64_t> key = graph.nodes[*last_gather].params;
    int64_t marked = 0;
    // The later point first, so the earlier index stays valid.
    if (last_release && *last_release > *last_wait) {
      insert(graph, *last_release + 1, key, graph.nodes[*last_release].operands);
      ++marked;
    }
    insert(graph, *last_wait + 1, key, after_last_compute(graph, *last_wait));
    return ++marked;
  }

 private:
  void insert(Graph& graph, size_t at, const std::vector<int64_t>& key,
              std::vector<Operand> after) const {
    Node mark;
    mark.kind = NodeKind::PrefetchNext;
    mark.params = key;
    mark.bytes = budget_.value_or(-1);
    mark.operands = std::move(after);
    graph.nodes.insert(graph.nodes.begin() + static_cast<std::ptrdiff_t>(at), std::move(mark));
  }

  // The output of the last compute node before `index`: what the mark is
  // ordered after (a full parameter would count as a use of it).
  static std::vector<Operand> after_last_compute(const Graph& graph, size_t index) {
    for (size_t i = index; i-- > 0;) {
      const Node& n = graph.nodes[i];
      if (n.kind == NodeKind::Compute && n.outputs.size() == 1) {
        return {Operand::of_value(n.outputs[0])};
      }
    }
    return {};
  }

  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<Pass> make_mark_graph_prefetch(std::optional<int64_t> budget_bytes) {
  return std::make_unique<MarkGraphPrefetch>(budget_bytes);
}

}  // namespace sharc::ir
