// Data dependence within a scheduling graph: which nodes a set of nodes
// reads from, directly or through other nodes.

#include <map>

#include "sharc/compiler/ir.h"

namespace sharc::ir {

Dependence::Dependence(const Graph& graph) : graph_(graph) {
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    for (const std::string& v : graph.nodes[i].outputs) definer_[v] = i;
  }
}

std::set<size_t> Dependence::ancestors(const std::vector<size_t>& seeds, size_t from) const {
  std::set<size_t> seen(seeds.begin(), seeds.end());
  std::vector<size_t> todo(seeds.begin(), seeds.end());
  while (!todo.empty()) {
    const size_t n = todo.back();
    todo.pop_back();
    for (const Operand& o : graph_.nodes[n].operands) {
      if (o.is_param()) continue;
      auto it = definer_.find(o.value);
      if (it == definer_.end() || it->second < from) continue;
      if (seen.insert(it->second).second) todo.push_back(it->second);
    }
  }
  return seen;
}

std::vector<size_t> Dependence::definers(const std::vector<Operand>& operands) const {
  std::vector<size_t> out;
  for (const Operand& o : operands) {
    auto it = o.is_param() ? definer_.end() : definer_.find(o.value);
    if (it != definer_.end()) out.push_back(it->second);
  }
  return out;
}

}  // namespace sharc::ir
