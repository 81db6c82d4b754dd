// The IR verifier: the schedule rules every pass must preserve.

#include <map>
#include <set>

#include "sharc/core/error.h"
#include "sharc/compiler/ir.h"
#include "sharc/compiler/memory.h"

namespace sharc::ir {
namespace {

class Verifier {
 public:
  Verifier(const Graph& graph, const VerifyOptions& options, const Dependence& dependence)
      : graph_(graph), options_(options), dependence_(dependence) {}

  std::vector<std::string> run() {
    for (size_t i = 0; i < graph_.nodes.size(); ++i) {
      visit(i, graph_.nodes[i]);
    }
    finish();
    return errors_;
  }

 private:
  template <typename... Parts>
  void fail(size_t index, const Parts&... parts) {
    errors_.push_back(detail::concat("node ", index, " (", to_string(graph_.nodes[index].kind),
                                     "): ", parts...));
  }

  void define(size_t index, const Node& n) {
    for (const std::string& v : n.outputs) {
      if (!defined_.insert(v).second) fail(index, "%", v, " is defined twice");
    }
  }

  // A read of an operand by a node that computes with it.
  void use(size_t index, const Operand& o) {
    if (o.is_param()) {
      if (options_.demands(Rule::GathersInserted)) {
        fail(index, "reads parameter @", *o.param, " directly; gather and wait first");
      }
      return;
    }
    if (!defined_.count(o.value)) {
      fail(index, "uses %", o.value, " before it is defined");
      return;
    }
    if (gathers_.count(o.value)) {
      fail(index, "uses gather %", o.value, " before waiting on it");
    }
    auto full = full_values_.find(o.value);
    if (full != full_values_.end()) {
      const int64_t p = full->second;
      if (!live_.count(p)) fail(index, "uses parameter @", p, " after its release");
      users_[p].insert(index);
    }
  }

  void visit(size_t index, const Node& n) {
    if (n.bytes_expr) check_symbolic_size(index, n);
    switch (n.kind) {
      case NodeKind::Input:
        for (int64_t p : n.params) {
          if (options_.demands(Rule::NoSavedParams)) {
            fail(index, "receives full parameter @", p,
                 " saved by forward; backward must gather it again from the shard");
          }
        }
        break;
      case NodeKind::Gather: visit_gather(index, n); break;
      case NodeKind::Wait: visit_wait(index, n); break;
      case NodeKind::Release: visit_release(index, n); break;
      case NodeKind::ReduceScatter: visit_reduce(index, n); break;
      case NodeKind::WaitReduce: visit_wait_reduce(index, n); break;
      case NodeKind::AllReduce: visit_all_reduce(index, n); break;
      case NodeKind::PrefetchNext:  // its parameters name the graph; no use
        for (const Operand& o : n.operands) use(index, o);
        break;
      case NodeKind::Compute:
      case NodeKind::Output:
        for (const Operand& o : n.operands) use(index, o);
        if (n.kind == NodeKind::Output) {
          for (const Operand& o : n.operands) returned_.insert(o.value);
        }
        if (n.grad_of) gradients_[n.outputs.empty() ? "" : n.outputs[0]] = *n.grad_of;
        if (n.grad_of) reductions_.emplace(*n.grad_of, 0);
        break;
    }
    define(index, n);
  }

  // A symbolic size reads declared symbols only, equals `bytes=` at the
  // hints, and never belongs to a parameter's gradient: buckets are sized
  // from gradient bytes, so those must hold for every size the graph sees.
  void check_symbolic_size(size_t index, const Node& n) {
    if (n.kind != NodeKind::Input && n.kind != NodeKind::Compute) {
      fail(index, "a ", to_string(n.kind), " node has no size of its own to make symbolic");
      return;
    }
    if (n.grad_of) {
      fail(index, "the gradient of @", *n.grad_of, " has a symbolic size (\"", *n.bytes_expr,
           "\"); a parameter's gradient has the parameter's static size");
    }
    try {
      check_size_at_hints(index, n, SizeExpr::parse(*n.bytes_expr));
    } catch (const Error& e) {
      fail(index, e.what());
    }
  }

  void check_size_at_hints(size_t index, const Node& n, const SizeExpr& expr) {
    bool hinted = true;
    for (const std::string& s : expr.symbols()) {
      auto it = graph_.size_symbols.find(s);
      if (it == graph_.size_symbols.end()) {
        fail(index, "size \"", *n.bytes_expr, "\" reads ", s,
             ", which no line 'size ", s, " [hint=N]' declares");
        return;
      }
      hinted = hinted && it->second.has_value();
    }
    if (!hinted) return;  // a data-dependent size: bytes= is a guess
    const int64_t at_hints = expr.evaluate(graph_.size_hints());
    if (at_hints != n.bytes) {
      fail(index, "bytes=", n.bytes, " but its size \"", *n.bytes_expr, "\" is ", at_hints,
           " at the size hints");
    }
  }

  void visit_gather(size_t index, const Node& n) {
    if (n.outputs.size() != 1) fail(index, "must define exactly one value");
    for (int64_t p : n.params) {
      if (!graph_.params.count(p)) fail(index, "gathers undeclared parameter @", p);
      if (live_.count(p) || in_flight_.count(p)) {
        fail(index, "gathers @", p, " again before releasing it");
      }
      in_flight_.insert(p);
    }
    check_one_dtype(index, n);
    if (!n.outputs.empty()) gathers_[n.outputs[0]] = n.params;
  }

  // The runtime gathers a bucket as one collective of one dtype; a parameter
  // of unknown dtype counts as a dtype of its own.
  void check_one_dtype(size_t index, const Node& gather) {
    std::set<std::optional<std::string>> dtypes;
    std::string listing;
    for (int64_t p : gather.params) {
      auto param = graph_.params.find(p);
      if (param == graph_.params.end()) continue;
      dtypes.insert(param->second.dtype);
      listing += detail::concat(listing.empty() ? "" : ", ", "@", p, " ",
                                param->second.dtype.value_or("unknown"));
    }
    if (dtypes.size() < 2) return;
    fail(index, gather.outputs.empty() ? "a gather" : "%" + gather.outputs[0],
         " serves parameters of different dtypes (", listing,
         "); one gather is one collective of one dtype");
  }

  void visit_wait(size_t index, const Node& n) {
    if (n.operands.size() != 1 || !gathers_.count(n.operands[0].value)) {
      fail(index, "must wait on exactly one gather in flight");
      return;
    }
    if (options_.demands(Rule::WaitsFollowGathers)) check_follows_its_gather(index, n);
    const std::vector<int64_t> params = gathers_[n.operands[0].value];
    gathers_.erase(n.operands[0].value);
    if (n.outputs.size() != params.size()) {
      fail(index, "yields ", n.outputs.size(), " values for ", params.size(), " parameters");
    }
    for (size_t i = 0; i < params.size(); ++i) {
      in_flight_.erase(params[i]);
      live_.insert(params[i]);
      if (i < n.outputs.size()) full_values_[n.outputs[i]] = params[i];
    }
  }

  // Bucketing fuses gather/wait pairs and relies on finding them adjacent.
  void check_follows_its_gather(size_t index, const Node& wait) {
    const Node* before = index > 0 ? &graph_.nodes[index - 1] : nullptr;
    if (before && before->kind == NodeKind::Gather && !before->outputs.empty() &&
        before->outputs[0] == wait.operands[0].value) {
      return;
    }
    fail(index, "waits on %", wait.operands[0].value, ", which is not the node right before it");
  }

  void visit_release(size_t index, const Node& n) {
    for (const Operand& o : n.operands) {
      if (!o.is_param() && !defined_.count(o.value)) {
        fail(index, "waits for %", o.value, " before it is defined");
      }
    }
    for (int64_t p : n.params) {
      if (!live_.erase(p)) {
        fail(index, "releases @", p, " which is not gathered");
        continue;
      }
      check_tied_to_every_user(index, n, p);
      users_.erase(p);
    }
  }

  // The release must depend, directly or through later users, on every node
  // that used the parameter since its wait: a compiler may compute any use
  // late (fused into a later kernel), and only a data dependence stops it
  // from running after the storage is freed.
  void check_tied_to_every_user(size_t index, const Node& n, int64_t p) {
    if (users_[p].empty()) return;
    const size_t since = *users_[p].begin();
    const std::set<size_t> covered = dependence_.ancestors(dependence_.definers(n.operands), since);
    for (size_t u : users_[p]) {
      if (!graph_.nodes[u].outputs.empty() && !covered.count(u)) {
        fail(index, "release of @", p, " does not depend on its user (node ", u, ")");
      }
    }
  }

  void visit_reduce(size_t index, const Node& n) {
    if (n.outputs.size() != 1) {
      fail(index, "must define exactly one value, the token its wait_reduce waits on");
    } else {
      reductions_in_flight_[n.outputs[0]] = n.params;
    }
    if (n.params.size() != n.operands.size()) {
      fail(index, "reduces ", n.operands.size(), " values for ", n.params.size(), " parameters");
      return;
    }
    for (size_t i = 0; i < n.params.size(); ++i) {
      use(index, n.operands[i]);
      auto g = gradients_.find(n.operands[i].value);
      if (g == gradients_.end() || g->second != n.params[i]) {
        fail(index, "%", n.operands[i].value, " is not a gradient of @", n.params[i]);
        continue;
      }
      ++reductions_[n.params[i]];
    }
  }

  // A wait_reduce names its reduction only; it yields the shard gradients of
  // the reduction's parameters, in order.
  void visit_wait_reduce(size_t index, const Node& n) {
    if (!n.params.empty()) fail(index, "names parameters; its reduction names them");
    if (n.operands.size() != 1 || n.operands[0].is_param()) {
      fail(index, "must wait on exactly one reduction (a reduce_scatter's token)");
      return;
    }
    const std::string& token = n.operands[0].value;
    auto reduction = reductions_in_flight_.find(token);
    if (reduction == reductions_in_flight_.end()) {
      if (waited_reductions_.count(token)) {
        fail(index, "waits on %", token, " again; each reduction is waited on once");
      } else if (all_reduced_.count(token)) {
        fail(index, "waits on %", token, ", which an all_reduce took over; wait on the "
             "all_reduce's token");
      } else if (!defined_.count(token)) {
        fail(index, "waits on %", token, " before it is defined; a wait_reduce follows its "
             "reduce_scatter");
      } else {
        fail(index, "waits on %", token, ", which is not a reduce_scatter's token");
      }
      return;
    }
    if (options_.demands(Rule::ReplicasReduced) && !replicated_.count(token)) {
      fail(index, "waits on %", token, " before any all_reduce of it; with hybrid sharding "
           "every reduction is summed over the replicate group first "
           "(insert_replicate_all_reduce)");
    }
    const std::vector<int64_t> params = reduction->second;
    reductions_in_flight_.erase(reduction);
    waited_reductions_.insert(token);
    if (n.outputs.size() != params.size()) {
      fail(index, "yields ", n.outputs.size(), " values for ", params.size(), " parameters");
    }
    for (size_t i = 0; i < params.size() && i < n.outputs.size(); ++i) {
      shard_grads_[n.outputs[i]] = params[i];
    }
  }

  // An all_reduce names its reduction only and takes its token over: the
  // reduction's wait then waits on the all_reduce's token, once.
  void visit_all_reduce(size_t index, const Node& n) {
    if (!n.params.empty()) fail(index, "names parameters; its reduction names them");
    if (n.operands.size() != 1 || n.operands[0].is_param() || n.outputs.size() != 1) {
      fail(index, "must read exactly one reduction (a reduce_scatter's token) and define one "
           "token, the one its wait_reduce waits on");
      return;
    }
    const std::string& token = n.operands[0].value;
    auto reduction = reductions_in_flight_.find(token);
    if (reduction == reductions_in_flight_.end() || replicated_.count(token)) {
      if (all_reduced_.count(token) || replicated_.count(token)) {
        fail(index, "all-reduces %", token, " again; each reduction is all-reduced once");
      } else if (waited_reductions_.count(token)) {
        fail(index, "all-reduces %", token, " after its wait_reduce; the wait must come after");
      } else if (!defined_.count(token)) {
        fail(index, "all-reduces %", token, " before it is defined; an all_reduce follows "
             "its reduce_scatter");
      } else {
        fail(index, "all-reduces %", token, ", which is not a reduce_scatter's token");
      }
      return;
    }
    const std::vector<int64_t> params = reduction->second;
    reductions_in_flight_.erase(reduction);
    reductions_in_flight_[n.outputs[0]] = params;
    replicated_.insert(n.outputs[0]);
    all_reduced_.insert(token);
  }

  // Every reduction is waited on and its shard gradients leave the graph:
  // a reduction nobody waits on never delivers, and one whose gradients the
  // output does not read delivers nothing.
  void check_budget() {
    const GatheredPeak peak = peak_gathered(graph_);
    const int64_t budget = *options_.budget_bytes();
    if (peak.bytes <= budget) return;
    errors_.push_back(detail::concat("the schedule holds ", describe(graph_, peak),
                                     ", above the memory budget of ", budget, " bytes"));
  }

  void check_reductions_waited() {
    for (const auto& [token, params] : reductions_in_flight_) {
      std::string listing;
      for (int64_t p : params) listing += detail::concat(listing.empty() ? "@" : " @", p);
      errors_.push_back(detail::concat("reduction %", token, " (", listing,
                                       ") is never waited on; wait_reduce it before the output"));
    }
    for (const auto& [value, p] : shard_grads_) {
      if (!returned_.count(value)) {
        errors_.push_back(detail::concat("shard gradient %", value, " of @", p,
                                         " is not read by the output"));
      }
    }
  }

  void finish() {
    for (int64_t p : in_flight_) {
      errors_.push_back(detail::concat("parameter @", p, " is gathered but never waited on"));
    }
    for (int64_t p : live_) {
      errors_.push_back(detail::concat("parameter @", p, " is gathered but never released"));
    }
    if (options_.demands(Rule::ReductionsWaited)) check_reductions_waited();
    if (options_.demands(Rule::WithinBudget) && options_.budget_bytes()) check_budget();
    if (!options_.demands(Rule::GradientsReduced)) return;
    for (const auto& [p, count] : reductions_) {
      if (count != 1) {
        errors_.push_back(detail::concat("gradient of @", p, " is reduced ", count,
                                         " times; it must be reduced exactly once"));
      }
    }
  }

  const Graph& graph_;
  VerifyOptions options_;
  const Dependence& dependence_;
  std::vector<std::string> errors_;
  std::set<std::string> defined_;
  std::map<std::string, std::vector<int64_t>> gathers_;  // gather value -> params
  std::map<std::string, int64_t> full_values_;           // wait output -> param
  std::map<std::string, int64_t> gradients_;             // gradient value -> param
  std::map<int64_t, int> reductions_;                    // param -> reductions
  std::map<std::string, std::vector<int64_t>> reductions_in_flight_;  // token -> params
  std::set<std::string> waited_reductions_;                           // tokens waited on
  std::set<std::string> replicated_;  // all_reduce tokens (and so: not all-reducible again)
  std::set<std::string> all_reduced_;  // reduce_scatter tokens an all_reduce took over
  std::map<std::string, int64_t> shard_grads_;  // wait_reduce output -> param
  std::set<std::string> returned_;              // values the output reads
  std::map<int64_t, std::set<size_t>> users_;  // param -> nodes that used it since its wait
  std::set<int64_t> in_flight_;
  std::set<int64_t> live_;
};

}  // namespace

std::vector<std::string> verify(const Graph& graph, const VerifyOptions& options) {
  const Dependence dependence(graph);
  return verify(graph, options, dependence);
}

std::vector<std::string> verify(const Graph& graph, const VerifyOptions& options,
                                const Dependence& dependence) {
  return Verifier(graph, options, dependence).run();
}

}  // namespace sharc::ir
