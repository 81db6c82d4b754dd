#include <algorithm>
#include <optional>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/timeline.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

bool is_collective(const Node& n) {
  return n.kind == NodeKind::Gather || n.kind == NodeKind::ReduceScatter;
}

// Moves each gather, in program order, as early as the predicted run
// (timeline.h) says it must be issued to be done by its wait: its
// collective's time before the wait, or, when the channel is still busy with
// earlier collectives, as soon as the channel frees. Never above another
// collective: compute costs are this rank's own, so they may place a
// collective among compute nodes but must not decide the order of the
// collectives, which every rank must issue alike (that order is fixed by
// the passes before, from numbers every rank shares). Never above a release
// of one of its parameters. Under a memory budget, no further than the
// schedule stays within it.
class PrefetchByCost : public Pass {
  int64_t exposed_before_ = 0;
  int64_t exposed_after_ = 0;

 public:
  PrefetchByCost(CollectiveCostModel costs, std::optional<int64_t> budget)
      : costs_(costs), budget_(budget) {}

  std::string name() const override { return "prefetch_by_cost"; }

  // It moves gathers that exist, and must see every reduction to keep the
  // collectives' order.
  Contract contract() const override {
    return {{Rule::GathersInserted, Rule::GradientsReduced}, {}, {Rule::WaitsFollowGathers}};
  }

  int64_t run(Graph& graph, Analyses&) override {
    exposed_before_ = exposed_after_ = 0;
    if (!costs_.gather || !has_compute_costs(graph)) return 0;
    exposed_before_ = static_cast<int64_t>(predict(graph, costs_).exposed_us);
    int64_t moved = 0;
    for (size_t k = 0; k < graph.nodes.size(); ++k) {
      if (graph.nodes[k].kind != NodeKind::Gather) continue;
      const size_t to = target(graph, k);
      if (to == k) continue;
      Node gather = std::move(graph.nodes[k]);
      graph.nodes.erase(graph.nodes.begin() + static_cast<std::ptrdiff_t>(k));
      graph.nodes.insert(graph.nodes.begin() + static_cast<std::ptrdiff_t>(to), std::move(gather));
      ++moved;
    }
    exposed_after_ = static_cast<int64_t>(predict(graph, costs_).exposed_us);
    return moved;
  }

  // The predicted time the computation waits on collectives, in whole
  // microseconds, before and after the moves.
  std::map<std::string, int64_t> statistics() const override {
    return {{"exposed_us_before", exposed_before_}, {"exposed_us_after", exposed_after_}};
  }

 private:
  // Where gather `k` should go: an index in [lowest(k), k].
  size_t target(const Graph& graph, size_t k) const {
    const Timeline line = predict(graph, costs_);
    const size_t wait = wait_of(graph, k);
    const double deadline = line.start_us[wait];
    const double took = costs_.gather->time_us(gathered_bytes(graph, graph.nodes[k]));
    double channel_free = 0.0;
    for (size_t i = 0; i < k; ++i) channel_free = std::max(channel_free, line.done_us[i]);
    const double issue_by = channel_free + took <= deadline ? deadline - took : channel_free;
    const size_t lo = lowest(graph, k);
    size_t to = k;
    while (to > lo && line.start_us[to] > issue_by) --to;
    return within_budget(graph, k, to);
  }

  // The earliest index the gather may take: after the last collective, the
  // last release of one of its parameters and the graph's inputs before it.
  static size_t lowest(const Graph& graph, size_t k) {
    const Node& gather = graph.nodes[k];
    for (size_t i = k; i-- > 0;) {
      const Node& n = graph.nodes[i];
      if (is_collective(n) || n.kind == NodeKind::Input) return i + 1;
      if (n.kind != NodeKind::Release) continue;
      for (int64_t p : n.params) {
        if (std::find(gather.params.begin(), gather.params.end(), p) != gather.params.end()) {
          return i + 1;
        }
      }
    }
    return 0;
  }

  static size_t wait_of(const Graph& graph, size_t k) {
    const std::string& token = graph.nodes[k].outputs.at(0);
    for (size_t i = k + 1; i < graph.nodes.size(); ++i) {
      const Node& n = graph.nodes[i];
      if (n.kind == NodeKind::Wait && !n.operands.empty() && n.operands[0].value == token) {
        return i;
      }
    }
    throw Error(detail::concat("sharc: prefetch_by_cost found no wait for %", token));
  }

  // The earliest index in [to, k] at which gather `k` keeps the schedule
  // within the budget (moving it later only shortens what it keeps alive,
  // so the bytes fall as the index grows: a binary search).
  size_t within_budget(const Graph& graph, size_t k, size_t to) const {
    if (!budget_ || to == k) return to;
    size_t lo = to, hi = k;  // hi always fits: it is where the gather is
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      if (peak_gathered(graph, moved_order(graph.nodes.size(), k, mid)).bytes <= *budget_) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return hi;
  }

  // The order of the nodes with node `k` moved to index `to` (to <= k).
  static std::vector<size_t> moved_order(size_t size, size_t k, size_t to) {
    std::vector<size_t> order;
    order.reserve(size);
    for (size_t i = 0; i < size; ++i) {
      if (i == to) order.push_back(k);
      if (i != k) order.push_back(i);
    }
    return order;
  }

  CollectiveCostModel costs_;
  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<Pass> make_prefetch_by_cost(CollectiveCostModel costs,
                                            std::optional<int64_t> budget_bytes) {
  return std::make_unique<PrefetchByCost>(costs, budget_bytes);
}

}  // namespace sharc::ir
