#include <map>
#include <set>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

// Where a parameter is read: the first and last reading node, and every
// reading node in order.
struct Uses {
  size_t first = 0;
  size_t last = 0;
  std::vector<size_t> users;
};

class InsertGatherRelease : public Pass {
 public:
  std::string name() const override { return "insert_gather_release"; }

  int64_t run(Graph& graph, Analyses& analyses) override {
    const std::map<int64_t, Uses> uses = find_uses(graph);
    if (uses.empty()) return 0;
    const Dependence& dependence = analyses.dependence();
    std::vector<Node> out;
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      for (const auto& [p, u] : uses) {
        if (u.first == i) emit_gather(out, p);
      }
      Node& n = graph.nodes[i];
      for (Operand& o : n.operands) {
        if (o.is_param()) o = Operand::of_value(full_name(*o.param));
      }
      out.push_back(n);
      for (const auto& [p, u] : uses) {
        if (u.last == i) emit_release(out, p, graph.nodes, sinks(dependence, u));
      }
    }
    graph.nodes = std::move(out);
    return static_cast<int64_t>(uses.size());
  }

  // Each gather is emitted with its wait right behind it; bucketing relies on it.
  Contract contract() const override {
    return {{}, {Rule::GathersInserted, Rule::WaitsFollowGathers}, {}};
  }

 private:
  static std::map<int64_t, Uses> find_uses(const Graph& graph) {
    std::map<int64_t, Uses> uses;
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      for (const Operand& o : graph.nodes[i].operands) {
        if (!o.is_param()) continue;
        auto [it, fresh] = uses.try_emplace(*o.param, Uses{i, i, {}});
        it->second.last = i;
        if (it->second.users.empty() || it->second.users.back() != i) {
          it->second.users.push_back(i);
        }
      }
    }
    return uses;
  }

  static std::string full_name(int64_t p) { return "sharc_full_" + std::to_string(p); }

  static void emit_gather(std::vector<Node>& out, int64_t p) {
    Node gather;
    gather.kind = NodeKind::Gather;
    gather.outputs = {"sharc_gather_" + std::to_string(p)};
    gather.params = {p};
    Node wait;
    wait.kind = NodeKind::Wait;
    wait.outputs = {full_name(p)};
    wait.operands = {Operand::of_value(gather.outputs[0])};
    out.push_back(std::move(gather));
    out.push_back(std::move(wait));
  }

  // The users of a parameter that no later user reads from. The release
  // depends on their outputs, and through them on every use: a compiler may
  // compute an earlier use late (Inductor inlines a pointwise use into a
  // consumer it emits after the release), and only a data dependence forces
  // every read of the buffer to have run before its storage is freed.
  static std::vector<size_t> sinks(const Dependence& dependence, const Uses& u) {
    std::vector<size_t> sinks;
    std::set<size_t> covered;
    for (auto it = u.users.rbegin(); it != u.users.rend(); ++it) {
      if (covered.count(*it)) continue;
      sinks.insert(sinks.begin(), *it);
      for (size_t a : dependence.ancestors({*it}, u.first)) covered.insert(a);
    }
    return sinks;
  }

  static void emit_release(std::vector<Node>& out, int64_t p, const std::vector<Node>& nodes,
                           const std::vector<size_t>& sinks) {
    Node release;
    release.kind = NodeKind::Release;
    release.params = {p};
    for (size_t u : sinks) {
      for (const std::string& v : nodes[u].outputs) {
        release.operands.push_back(Operand::of_value(v));
      }
    }
    out.push_back(std::move(release));
  }
};

}  // namespace

std::unique_ptr<Pass> make_insert_gather_release() {
  return std::make_unique<InsertGatherRelease>();
}

}  // namespace sharc::ir
