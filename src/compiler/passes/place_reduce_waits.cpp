#include <optional>
#include <set>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Places one wait_reduce per reduction: right after the next reduction
// starts, so that reduction's collective is on its way while backward
// computes up to it and at most two are in flight; the last one right before
// the output, which reads every shard gradient.
class PlaceReduceWaits : public Pass {
 public:
  std::string name() const override { return "place_reduce_waits"; }

  // It waits on reductions that exist; with none inserted it has nothing to do.
  Contract contract() const override {
    return {{Rule::GradientsReduced}, {Rule::ReductionsWaited}, {}};
  }

  int64_t run(Graph& graph, Analyses&) override {
    const std::set<std::string> waited = waited_tokens(graph);
    int64_t placed = 0;
    std::vector<Node> out;
    std::optional<Node> pending;  // the wait of the last reduction started
    std::vector<Operand> shard_grads;
    for (Node& n : graph.nodes) {
      if (n.kind == NodeKind::Output && pending) out.push_back(take(pending));
      const bool starts = n.kind == NodeKind::ReduceScatter && n.outputs.size() == 1 &&
                          !waited.count(n.outputs[0]);
      out.push_back(std::move(n));
      if (!starts) continue;
      Node wait = wait_for(out.back());
      if (pending) out.push_back(take(pending));
      for (const std::string& v : wait.outputs) shard_grads.push_back(Operand::of_value(v));
      pending = std::move(wait);
      ++placed;
    }
    if (pending) out.push_back(take(pending));  // a graph without an output node
    for (Node& n : out) {
      if (n.kind != NodeKind::Output) continue;
      n.operands.insert(n.operands.end(), shard_grads.begin(), shard_grads.end());
      break;
    }
    graph.nodes = std::move(out);
    return placed;
  }

 private:
  // Tokens some wait_reduce already waits on: running twice places nothing.
  static std::set<std::string> waited_tokens(const Graph& graph) {
    std::set<std::string> waited;
    for (const Node& n : graph.nodes) {
      if (n.kind == NodeKind::WaitReduce && n.operands.size() == 1) {
        waited.insert(n.operands[0].value);
      }
    }
    return waited;
  }

  // The wait of `reduction`: one shard gradient per parameter, named after it.
  static Node wait_for(const Node& reduction) {
    Node wait;
    wait.kind = NodeKind::WaitReduce;
    wait.operands = {Operand::of_value(reduction.outputs[0])};
    for (int64_t p : reduction.params) {
      wait.outputs.push_back("sharc_shard_grad_" + std::to_string(p));
    }
    return wait;
  }

  static Node take(std::optional<Node>& pending) {
    Node n = std::move(*pending);
    pending.reset();
    return n;
  }
};

}  // namespace

std::unique_ptr<Pass> make_place_reduce_waits() { return std::make_unique<PlaceReduceWaits>(); }

}  // namespace sharc::ir
