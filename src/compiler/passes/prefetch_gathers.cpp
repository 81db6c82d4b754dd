#include <set>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Moves every gather up to right after the previous wait, so each collective
// is in flight while the compute between that wait and its own wait runs.
// Only one collective is ahead of the computation at any time, so this costs
// at most one more bucket of gathered bytes.
class PrefetchGathers : public Pass {
 public:
  std::string name() const override { return "prefetch_gathers"; }

  // It moves gathers that exist; with none inserted it has nothing to do.
  Contract contract() const override {
    return {{Rule::GathersInserted}, {}, {Rule::WaitsFollowGathers}};
  }

  int64_t run(Graph& graph) override {
    int64_t moved = 0;
    std::vector<Node> out;
    bool seen_wait = false;
    size_t insert_at = 0;          // right after the last wait emitted
    std::set<int64_t> released;    // since that wait
    for (Node& n : graph.nodes) {
      if (n.kind == NodeKind::Gather && seen_wait && insert_at < out.size() &&
          !any_released(n, released)) {
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
  // A parameter released after that wait must not be gathered again before
  // its release.
  static bool any_released(const Node& gather, const std::set<int64_t>& released) {
    for (int64_t p : gather.params) {
      if (released.count(p)) return true;
    }
    return false;
  }
};

}  // namespace

std::unique_ptr<Pass> make_prefetch_gathers() { return std::make_unique<PrefetchGathers>(); }

}  // namespace sharc::ir
