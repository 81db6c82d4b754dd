#include <optional>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Writes each collective's predicted time into its `cost=`, so a dumped
// schedule shows what the scheduler assumed next to the measured compute.
class AnnotateCollectiveCosts : public Pass {
 public:
  AnnotateCollectiveCosts(std::optional<CollectiveCost> gather,
                          std::optional<CollectiveCost> reduce)
      : gather_(gather), reduce_(reduce) {}

  std::string name() const override { return "annotate_collective_costs"; }

  Contract contract() const override {
    // Costs are attributes: no node moves, no parameter changes.
    return {{Rule::GathersInserted, Rule::GradientsReduced}, {}, {}, {},
            {Analysis::Dependence, Analysis::PlainSchedulePeak}};
  }

  int64_t run(Graph& graph, Analyses&) override {
    int64_t annotated = 0;
    for (Node& n : graph.nodes) {
      if (n.kind == NodeKind::Gather && gather_) {
        int64_t bytes = 0;
        for (int64_t p : n.params) bytes += graph.params.at(p).bytes;
        n.cost = gather_->time_us(bytes);
        ++annotated;
      } else if (n.kind == NodeKind::ReduceScatter && reduce_) {
        int64_t bytes = 0;
        for (const Operand& o : n.operands) bytes += graph.value_bytes(o.value);
        n.cost = reduce_->time_us(bytes);
        ++annotated;
      }
    }
    return annotated;
  }

 private:
  std::optional<CollectiveCost> gather_;
  std::optional<CollectiveCost> reduce_;
};

}  // namespace

std::unique_ptr<Pass> make_annotate_collective_costs(std::optional<CollectiveCost> gather_cost,
                                                     std::optional<CollectiveCost> reduce_cost) {
  return std::make_unique<AnnotateCollectiveCosts>(gather_cost, reduce_cost);
}

}  // namespace sharc::ir
