#include <algorithm>
#include <optional>
#include <set>
#include <vector>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Selective unsharding: which parameters stay gathered (kept) instead of
// being gathered again for backward. Keeping p saves one all-gather of p per
// step, gather_cost.time_us(bytes) microseconds, for p's bytes resident all
// along; so parameters are taken greedily by time saved per byte (small
// ones first: the latency dominates them), while the kept bytes fit in half
// of what the budget leaves above this graph's plain schedule. The other
// half is left to bucketing and prefetching.
class KeepGatheredParams : public Pass {
 public:
  KeepGatheredParams(std::optional<int64_t> budget, std::optional<CollectiveCost> cost,
                     std::optional<std::set<int64_t>> candidates)
      : budget_(budget), cost_(cost), candidates_(std::move(candidates)) {}

  std::string name() const override { return "keep_gathered_params"; }

  // It marks parameters read directly; insertion then serves them.
  // Marking parameters kept changes no node (the plain peak does change).
  Contract contract() const override {
    return {{}, {}, {}, {Rule::GathersInserted}, {Analysis::Dependence}};
  }

  int64_t run(Graph& graph, Analyses& analyses) override {
    kept_bytes_ = 0;
    if (!budget_ || !cost_) return 0;
    const int64_t headroom = *budget_ - analyses.plain_schedule_peak().bytes;
    int64_t allowance = headroom / 2;
    int64_t kept = 0;
    for (int64_t p : by_time_saved_per_byte(graph)) {
      Param& param = graph.params.at(p);
      if (param.bytes > allowance) continue;
      param.kept = true;
      allowance -= param.bytes;
      kept_bytes_ += param.bytes;
      ++kept;
    }
    return kept;
  }

  std::map<std::string, int64_t> statistics() const override {
    return {{"kept_bytes", kept_bytes_}};
  }

 private:
  // Parameters this graph reads and does not keep yet, best first (ties:
  // the smaller id, so every rank picks the same).
  std::vector<int64_t> by_time_saved_per_byte(const Graph& graph) const {
    std::set<int64_t> read;
    for (const Node& n : graph.nodes) {
      for (const Operand& o : n.operands) {
        if (!o.is_param() || graph.params.at(*o.param).kept) continue;
        if (candidates_ && !candidates_->count(*o.param)) continue;  // backward never reads it
        read.insert(*o.param);
      }
    }
    std::vector<int64_t> order(read.begin(), read.end());
    auto rate = [&](int64_t p) {
      const int64_t bytes = std::max<int64_t>(1, graph.params.at(p).bytes);
      return cost_->time_us(bytes) / static_cast<double>(bytes);
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return rate(a) > rate(b); });
    return order;
  }

  std::optional<int64_t> budget_;
  std::optional<CollectiveCost> cost_;
  std::optional<std::set<int64_t>> candidates_;
  int64_t kept_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Pass> make_keep_gathered_params(std::optional<int64_t> budget_bytes,
                                                std::optional<CollectiveCost> gather_cost,
                                                std::optional<std::set<int64_t>> candidates) {
  return std::make_unique<KeepGatheredParams>(budget_bytes, gather_cost, std::move(candidates));
}

}  // namespace sharc::ir
