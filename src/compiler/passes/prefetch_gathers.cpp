#include <optional>
#include <set>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Moves every gather up to right after the previous wait, so each collective
// is in flight while the compute between that wait and its own wait runs.
// Only one collective is ahead of the computation at any time, so this costs
// at most one more bucket of gathered bytes. Under a memory budget a move
// that would make the schedule exceed it is not made (that gather stays
// next to its wait).
class PrefetchGathers : public Pass {
 public:
  explicit PrefetchGathers(std::optional<int64_t> budget) : budget_(budget) {}

  std::string name() const override { return "prefetch_gathers"; }

  // It moves gathers that exist; with none inserted it has nothing to do.
  Contract contract() const override {
    return {{Rule::GathersInserted}, {}, {Rule::WaitsFollowGathers}};
  }

  int64_t run(Graph& graph, Analyses&) override {
    int64_t moved = 0;
    std::vector<Node> out;
    bool seen_wait = false;
    size_t insert_at = 0;          // right after the last wait emitted
    std::set<int64_t> released;    // since that wait
    for (size_t k = 0; k < graph.nodes.size(); ++k) {
      Node& n = graph.nodes[k];
      if (n.kind == NodeKind::Gather && seen_wait && insert_at < out.size() &&
          !any_released(n, released) && fits(graph, out, insert_at, k)) {
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(insert_at), std::move(n));
        ++insert_at;  // later gathers queue behind this one
        ++moved;
        continue;
      }
      out.push_back(std::move(n));
      const Node& last = out.back();
      if (last.kind == NodeKind::Wait) {
        seen_wait = true;
        insert_at = out.size();
        released.clear();
      } else if (last.kind == NodeKind::Release) {
        released.insert(last.params.begin(), last.params.end());
      }
    }
    graph.nodes = std::move(out);
    return moved;
  }

 private:
  // Whether moving gather `k` to `out[at]` keeps the whole schedule (what is
  // placed so far, then the rest) within the budget.
  bool fits(const Graph& graph, const std::vector<Node>& out, size_t at, size_t k) const {
    if (!budget_) return true;
    Graph trial{graph.params, graph.size_symbols, {}};
    trial.nodes.reserve(graph.nodes.size());
    trial.nodes.insert(trial.nodes.end(), out.begin(), out.begin() + static_cast<std::ptrdiff_t>(at));
    trial.nodes.push_back(graph.nodes[k]);
    trial.nodes.insert(trial.nodes.end(), out.begin() + static_cast<std::ptrdiff_t>(at), out.end());
    trial.nodes.insert(trial.nodes.end(), graph.nodes.begin() + static_cast<std::ptrdiff_t>(k) + 1,
                       graph.nodes.end());
    return peak_gathered(trial).bytes <= *budget_;
  }

  // A parameter released after that wait must not be gathered again before
  // its release.
  static bool any_released(const Node& gather, const std::set<int64_t>& released) {
    for (int64_t p : gather.params) {
      if (released.count(p)) return true;
    }
    return false;
  }

  std::optional<int64_t> budget_;
};

}  // namespace

std::unique_ptr<Pass> make_prefetch_gathers(std::optional<int64_t> budget_bytes) {
  return std::make_unique<PrefetchGathers>(budget_bytes);
}

}  // namespace sharc::ir
