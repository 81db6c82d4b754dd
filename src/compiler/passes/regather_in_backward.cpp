#include <map>

#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

class RegatherInBackward : public Pass {
 public:
  std::string name() const override { return "regather_in_backward"; }

  int64_t run(Graph& graph, Analyses&) override {
    std::map<std::string, int64_t> saved;  // value -> parameter
    std::vector<Node> kept;
    for (Node& n : graph.nodes) {
      if (n.kind == NodeKind::Input && n.params.size() == 1 && n.outputs.size() == 1) {
        saved[n.outputs[0]] = n.params[0];
        continue;
      }
      kept.push_back(std::move(n));
    }
    int64_t rewrites = static_cast<int64_t>(saved.size());
    for (Node& n : kept) {
      for (Operand& o : n.operands) {
        auto it = saved.find(o.value);
        if (!o.is_param() && it != saved.end()) o = Operand::of_param(it->second);
      }
      if (n.kind == NodeKind::Output) rewrites += drop_parameter_outputs(n);
    }
    graph.nodes = std::move(kept);
    return rewrites;
  }

  Contract contract() const override { return {{}, {Rule::NoSavedParams}, {}}; }

 private:
  // Forward must not hand full parameters to backward.
  static int64_t drop_parameter_outputs(Node& output) {
    const size_t before = output.operands.size();
    std::vector<Operand> kept;
    for (Operand& o : output.operands) {
      if (!o.is_param()) kept.push_back(std::move(o));
    }
    output.operands = std::move(kept);
    return static_cast<int64_t>(before - output.operands.size());
  }
};

}  // namespace

std::unique_ptr<Pass> make_regather_in_backward() {
  return std::make_unique<RegatherInBackward>();
}

}  // namespace sharc::ir
