#pragma once
// Eager prefetch, the runtime's side: which groups of parameters to gather
// ahead, for each sharded root, from the order its last pass of each kind
// gathered them in (see [Note: gather order] in core/gather_order.h).
//
// [Note: eager prefetch]
// Without a compiler, a parameter is gathered when code reads it: one
// blocking collective per parameter. Each root keeps a GatherOrder per kind
// of pass. In forward a step is the parameters first gathered inside one
// module's forward; in backward the parameters of one forward step, in the
// order backward asks for them. Every read is both of the order's events:
// a gather the code asks for (which starts the rest of its module's step,
// with it, as one bucketed collective) and the point after it (which
// starts the next module's step). So one module is gathered ahead, and a
// module costs one collective instead of one per parameter. The forward
// pass ends when the root's outermost module exits, the backward at the
// end of backward; what was gathered ahead and nobody took is freed there.
//
// Python reports events only: a module's forward begins or ends, backward
// gathers a parameter again, backward ended. The forward's own reads reach
// here from the gather operator itself.
//
// [Note: gather units ahead]
// A gather unit (ShardConfig.gather_units) is gathered whole when its
// forward begins and again when the gradient of its output arrives, points
// every rank reaches alike, so its members stay out of the orders above.
// Units keep orders of their own, one per kind of pass, whose steps are
// units: gathering a unit starts the unit that followed it last pass, so
// the next unit's collective runs under the code between the two (on a
// model whose graphs break at every unit, that is the only overlap its
// unit gathers get). One unit ahead at most, as one module ahead above.
// Both passes end at the end of backward, where a unit gathered ahead
// and not entered is freed; a unit started before its shards changed (an
// optimizer step after a forward that stopped early) is given up before
// anything of its order is used. A forward recomputed inside backward
// (activation checkpointing) gathers its units without the order.

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "sharc/core/gather_order.h"

namespace sharc {

class Runtime;

class EagerPrefetch {
 public:
  explicit EagerPrefetch(Runtime& runtime) : runtime_(runtime) {}

  /// Root `root` prefetches (or not), never its gather units' `excluded`.
  void configure(int64_t root, bool enabled, const std::vector<int64_t>& excluded);
  /// A module of `root` begins its forward; the module ends its forward.
  void enter_module(int64_t root);
  void exit_module();
  /// The forward reads `id` inside the innermost open module.
  void on_forward_gather(int64_t id);
  /// Backward of `root` gathers `id` again.
  void on_backward_gather(int64_t root, int64_t id);
  /// The backward pass of `root` ended.
  void end_backward(int64_t root);
  /// Gather unit `unit` of `root` (its parameters `ids`) is gathered for
  /// its forward, for its backward, or (kPlain) outside both orders:
  /// starts its gather unless in flight, and the unit after it ahead. See
  /// [Note: gather units ahead].
  enum class UnitPass { kForward, kBackward, kPlain };
  void start_unit(int64_t root, int64_t unit, const std::vector<int64_t>& ids, UnitPass pass);

 private:
  struct Root {
    bool enabled = true;
    GatherOrder forward;
    GatherOrder backward;
    GatherOrder unit_forward;   ///< steps are gather units
    GatherOrder unit_backward;
  };
  /// `id` is read in step `step` of `order`'s pass: both of its events.
  void read_locked(GatherOrder& order, int64_t step, int64_t id);
  void apply_locked(const GatherOrder::Decision& decision);
  void end_pass_locked(GatherOrder& order);

  Runtime& runtime_;
  std::mutex mutex_;
  std::map<int64_t, Root> roots_;
  /// Modules whose forward runs now, innermost last: (root, module serial).
  std::vector<std::pair<int64_t, int64_t>> open_;
  int64_t next_module_ = 0;
};

}  // namespace sharc
