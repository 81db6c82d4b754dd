#pragma once
// sharc's scheduling IR: one FX graph reduced to what scheduling needs.
//
// A Graph is an ordered list of nodes over named values. Each value has a
// byte size; each communication node names the parameters it serves. Text
// form, one node per line ('#' starts a comment):
//
//   param @0 "blocks.0.fc.weight" bytes=4096 dtype=float32
//                                                  declares a sharded parameter
//   param @1 "ln.weight" bytes=64 dtype=float32 kept  one that stays gathered
//   size s0 hint=16                                a size symbol (dynamic shapes)
//   size u0                                        one with no hint (data-dependent)
//   %x = input bytes=256                           graph input
//   %t = input bytes=64 sym="4*s0"                 one whose size varies
//   %w = input param=@0                            full parameter saved by forward
//   %g = gather @0 @1                              all-gather in flight (bucket)
//   %w0, %w1 = wait %g                             full parameters, usable
//   %y = compute "mm" %x %w0 bytes=256 cost=1.5    any other operation
//   %dw = compute "mm" %x %y bytes=4096 grad=@0    produces @0's gradient
//   %h = compute "convert" %y bytes=128 cast=bfloat16
//                                                  converts its operand's dtype
//   release @0 after %y                            free after the last use
//   %r = reduce_scatter @0 @1 %dw0 %dw1            gradient reduction in flight (bucket)
//   %s0, %s1 = wait_reduce %r                      shard gradients of @0 and @1
//   %a = all_reduce %r                             hybrid sharding: the reduction's
//                                                  shard sums over the replicate group
//   prefetch_next @0 @1 after %y bytes=8192        the next graph's first gather
//                                                  may start here (see below)
//   output %y %s0 %s1
//
// A compute node may also read a parameter directly (`@0` as an operand):
// that is a use the insertion pass turns into gather / wait / release.
//
// A reduce_scatter defines a token: the reduction in flight. One wait_reduce
// waits on it and defines the shard gradients of its parameters, in order;
// they leave the graph through the output, which reads them. The IR does not
// model a shard's size (it depends on the world size), so a token and a shard
// gradient have 0 bytes.
//
// Hybrid sharding (docs/design/hybrid-sharding.md): an all_reduce reads a
// reduce_scatter's token (the reduction's collective must be done before
// it starts, so it is issued once the reduce-scatter completed) and
// defines a new token, the same reduction with its shard sums now being
// summed over the replicate group; its one wait_reduce waits on that token
// instead. Like a wait_reduce it names its reduction only.
//
// A prefetch_next marks where the next compiled graph's first gather may
// start (cross-graph prefetch, sharc/core/gather_order.h). Its parameters
// name this graph (they are its last gather's), not uses; its `bytes` is the
// memory budget the runtime holds that gather to (-1: none); `after` orders
// it after those values.
//
// Sizes may be symbolic (size_expr.h): a graph compiled with dynamic shapes
// declares its size symbols with the value each had when the graph was
// first compiled (its hint), and a value whose size varies carries
// `sym="EXPR"` beside `bytes=`, which is then the size at the hints. The
// verifier holds `bytes=` to the expression at the hints. Parameters, and
// so everything gathered, released or reduced, always have static sizes:
// a `param` line takes no `sym=`, and neither does a node that produces a
// parameter's gradient. Every decision a pass makes from bytes (buckets,
// budget, prefetch distance, kept parameters) therefore holds for every size
// the graph can see; only compute costs, measured at the hints, are
// estimates for other sizes.
//
// A parameter's `bytes` and `dtype` are those of its gathered (full) value;
// after its name they come in any order, and `dtype=` may be left out (the
// dtype is then unknown). `kept` marks a parameter that stays gathered
// across graphs (Param::kept). Dtypes are torch's names without `torch.`
// (dtype.h). `cast=D` marks a compute node as an element-wise conversion of
// its single operand to dtype D. Printing puts a param's `bytes=` before its
// `dtype=`, size lines after the params, and a node's attributes in the order
// bytes, sym, grad, cast, cost.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sharc/compiler/size_expr.h"

namespace sharc::ir {

enum class NodeKind {
  Input, Compute, Gather, Wait, Release, ReduceScatter, WaitReduce, PrefetchNext, Output,
  AllReduce
};

const char* to_string(NodeKind kind);

/// An operand: a value (%name) or a parameter read directly (@id).
struct Operand {
  std::string value;            ///< value name without '%', empty for a parameter
  std::optional<int64_t> param; ///< set for a direct parameter read

  static Operand of_value(std::string name) { return {std::move(name), std::nullopt}; }
  static Operand of_param(int64_t id) { return {"", id}; }
  bool is_param() const { return param.has_value(); }
};

struct Node {
  NodeKind kind = NodeKind::Compute;
  std::vector<std::string> outputs;  ///< value names defined here
  std::vector<Operand> operands;
  std::vector<int64_t> params;       ///< parameters served (comm nodes, input param=)
  std::string op;                    ///< compute: the operation's name
  int64_t bytes = 0;                 ///< bytes of the (single) output, if any (its hint)
  /// The output's size as an expression over the graph's size symbols
  /// (size_expr.h), when it varies; `bytes` is then its value at the hints.
  std::optional<std::string> bytes_expr;
  std::optional<int64_t> grad_of;    ///< compute: produces this parameter's gradient
  std::optional<std::string> cast;   ///< compute: converts its one operand to this dtype
  std::optional<double> cost;        ///< measured cost, when known
};

struct Param {
  /// The graph's own number for it (`@id`), not the runtime's id: the
  /// bridge names a parameter "group/runtime id" (docs/architecture.md,
  /// "One parameter, four names").
  int64_t id = 0;
  std::string name;
  int64_t bytes = 0;                 ///< bytes of the full (gathered) parameter
  std::optional<std::string> dtype;  ///< dtype of the gathered parameter; unset: unknown
  /// Stays gathered across graphs and steps (the runtime's persistent
  /// parameters, chosen by selective unsharding or ShardConfig.keep_gathered):
  /// its gather is a no-op while gathered and unchanged, its release always.
  bool kept = false;
};

struct Graph {
  std::map<int64_t, Param> params;
  /// Size symbols and their hints (unset: no hint, a data-dependent size).
  std::map<std::string, std::optional<int64_t>> size_symbols;
  std::vector<Node> nodes;

  /// Bytes of a value at the hints: an input's, a compute's, or the
  /// gathered parameter that a wait yields (0 for a reduction's token and
  /// shard gradients). Throws sharc::Error for unknown values.
  int64_t value_bytes(const std::string& value) const;
  /// Bytes of a value when the size symbols take `sizes` (a symbol left out
  /// takes its hint); throws sharc::Error for a symbol with neither.
  int64_t value_bytes(const std::string& value, const SizeBindings& sizes) const;
  /// The hints of the size symbols that have one.
  SizeBindings size_hints() const;
};

/// Which nodes feed which: built once over a graph (which must outlive it).
class Dependence {
 public:
  explicit Dependence(const Graph& graph);
  /// `seeds` and every node at index >= `from` whose outputs they read,
  /// directly or transitively. A node computed by a compiler before any of
  /// the seeds completes is in this set, whatever the compiler fuses.
  std::set<size_t> ancestors(const std::vector<size_t>& seeds, size_t from) const;
  /// The nodes defining the value operands (parameter operands are skipped).
  std::vector<size_t> definers(const std::vector<Operand>& operands) const;

 private:
  const Graph& graph_;
  std::map<std::string, size_t> definer_;
};

/// Parses the text form; throws sharc::Error naming the line on bad input.
Graph parse(const std::string& text);
/// Prints the text form; parse(print(g)) == g.
std::string print(const Graph& graph);

/// A rule of the schedule that a pass establishes. The verifier always
/// checks the structural rules (every value defined once before use; every
/// gather waited once before its parameters are used; every gathered
/// parameter released after its last use, by a release that depends on that
/// use, and never used after release; every wait_reduce waits, once, on a
/// reduction started before it) and, on request, these.
enum class Rule {
  NoSavedParams,       ///< no input is a full parameter saved by forward
  GathersInserted,     ///< no node reads a parameter directly (`@k` operand)
  WaitsFollowGathers,  ///< every wait comes right after the gather it waits on
  GradientsReduced,    ///< every gradient is reduced exactly once
  /// every reduction is waited on, and the output reads every shard gradient
  ReductionsWaited,
  /// hybrid sharding: every reduction is all-reduced over the replicate
  /// group (one all_reduce of its token) before its wait_reduce
  ReplicasReduced,
  /// the bytes gathered at once (memory.h) never exceed the memory budget
  /// (VerifyOptions::cap_gathered)
  WithinBudget,
};

/// The rule as messages name it, e.g. "gathers inserted".
const char* to_string(Rule rule);

/// Which rules, beyond the structural ones, a graph must satisfy. Built by
/// name: `VerifyOptions::complete().waive(Rule::GradientsReduced)`.
class VerifyOptions {
 public:
  /// Only the structural rules: what a graph straight from the bridge
  /// satisfies (it reads parameters directly and reduces no gradient).
  static VerifyOptions structural() { return VerifyOptions(); }
  /// What every finished schedule satisfies: no saved full parameters,
  /// gathers inserted, gradients reduced, reductions waited. (Not
  /// WaitsFollowGathers: prefetching moves gathers away from their waits.)
  static VerifyOptions complete() {
    return structural()
        .require(Rule::NoSavedParams)
        .require(Rule::GathersInserted)
        .require(Rule::GradientsReduced)
        .require(Rule::ReductionsWaited);
  }

  VerifyOptions& require(Rule rule) {
    rules_.insert(rule);
    return *this;
  }
  VerifyOptions& waive(Rule rule) {
    rules_.erase(rule);
    return *this;
  }
  bool demands(Rule rule) const { return rules_.count(rule) > 0; }

  /// Demands WithinBudget with this many bytes as the cap.
  VerifyOptions& cap_gathered(int64_t budget_bytes) {
    budget_bytes_ = budget_bytes;
    return require(Rule::WithinBudget);
  }
  std::optional<int64_t> budget_bytes() const { return budget_bytes_; }

 private:
  VerifyOptions() = default;
  std::set<Rule> rules_;
  std::optional<int64_t> budget_bytes_;
};

/// Checks the structural rules and those `options` demand; returns one
/// message per violation (empty if none).
std::vector<std::string> verify(const Graph& graph,
                                const VerifyOptions& options = VerifyOptions::complete());
/// The same with `graph`'s dependence already computed (analysis.h).
std::vector<std::string> verify(const Graph& graph, const VerifyOptions& options,
                                const Dependence& dependence);

}  // namespace sharc::ir
