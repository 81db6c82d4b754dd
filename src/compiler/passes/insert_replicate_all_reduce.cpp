#include <optional>
#include <set>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Hybrid sharding (docs/design/hybrid-sharding.md): every reduction's shard
// sums are all-reduced over the replicate group before they are used. The
// all_reduce of a reduction goes where place_reduce_waits put its wait:
// right after the next reduction started, so its reduce-scatter has had
// that stretch of backward to finish (the runtime waits for it before the
// all-reduce starts). Its wait then moves one place on: right after the
// next all_reduce starts (or before the output), so each all-reduce crosses
// the slow link while backward computes up to the next one, and at most
// two are in flight, as with the reduce-scatters.
class InsertReplicateAllReduce : public Pass {
 public:
  explicit InsertReplicateAllReduce(int64_t replicas) : replicas_(replicas) {}

  std::string name() const override { return "insert_replicate_all_reduce"; }

  Contract contract() const override {
    if (replicas_ <= 1) return {{}, {}, {}};  // flat sharding: nothing to do or promise
    return {{Rule::ReductionsWaited}, {Rule::ReplicasReduced}, {}};
  }

  int64_t run(Graph& graph, Analyses&) override {
    if (replicas_ <= 1) return 0;
    const std::set<std::string> replicated = replicated_tokens(graph);
    int64_t inserted = 0;
    std::vector<Node> out;
    std::optional<Node> pending;  // the wait of the last all_reduce placed
    for (Node& n : graph.nodes) {
      if (n.kind == NodeKind::Output && pending) out.push_back(take(pending));
      const bool waits_unreplicated = n.kind == NodeKind::WaitReduce && n.operands.size() == 1 &&
                                      !replicated.count(n.operands[0].value);
      if (!waits_unreplicated) {
        out.push_back(std::move(n));
        continue;
      }
      Node all_reduce;
      all_reduce.kind = NodeKind::AllReduce;
      all_reduce.operands = n.operands;
      all_reduce.outputs = {n.operands[0].value + "_replicas"};
      n.operands = {Operand::of_value(all_reduce.outputs[0])};
      out.push_back(std::move(all_reduce));
      if (pending) out.push_back(take(pending));
      pending = std::move(n);
      ++inserted;
    }
    if (pending) out.push_back(take(pending));  // a graph without an output node
    graph.nodes = std::move(out);
    return inserted;
  }

 private:
  // Tokens an all_reduce already took over: running twice inserts nothing.
  static std::set<std::string> replicated_tokens(const Graph& graph) {
    std::set<std::string> tokens;
    for (const Node& n : graph.nodes) {
      if (n.kind == NodeKind::AllReduce && n.outputs.size() == 1) tokens.insert(n.outputs[0]);
    }
    return tokens;
  }

  static Node take(std::optional<Node>& pending) {
    Node n = std::move(*pending);
    pending.reset();
    return n;
  }

  int64_t replicas_;
};

}  // namespace

std::unique_ptr<Pass> make_insert_replicate_all_reduce(int64_t replicas) {
  return std::make_unique<InsertReplicateAllReduce>(replicas);
}

}  // namespace sharc::ir
