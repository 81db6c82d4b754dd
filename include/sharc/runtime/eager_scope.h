#pragma once
// The eager path's owner of gathered parameters: what is gathered, held and
// released in forward scopes, for backward and for gather units (see
// [Note: eager holds] in core/eager_holds.h).
//
// Python's EagerSchedule reports events only: a module's forward begins or
// ends, code reads a parameter, autograd saves or unpacks a tensor, backward
// reached a gather unit. This object decides what to gather and when to
// release, and the runtime's end-of-backward callback (the one it queues for
// compiled backward graphs too) ends the eager backward work here.
//
// Thread safety: one mutex guards the bookkeeping; it is never held across a
// gather, a release or an operator call (backward runs on engine threads,
// and an operator may call into Python).

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "sharc/core/eager_holds.h"
#include "sharc/runtime/eager_prefetch.h"

namespace c10 {
struct StorageImpl;
}

namespace sharc {

class Runtime;

class EagerScope {
 public:
  explicit EagerScope(Runtime& runtime) : runtime_(runtime) {}

  /// Sharded root `root` owns `ids`: a saved tensor in one of their
  /// buffers is kept as a handle (saved_param). `tied`, among them, are
  /// installed in more than one module: held for the whole forward pass
  /// (see [Note: eager holds]). Does not communicate.
  void add_root(int64_t root, const std::vector<int64_t>& ids,
                const std::vector<int64_t>& tied = {});
  /// A gather unit of `root` (ShardConfig.gather_units): `ids` and their
  /// shards (the nn.Parameters, whose `.grad` the unit's reduction adds
  /// to). Returns its index for the unit events below.
  /// `keep`: the unit keeps its forward hold until its backward (see
  /// exit_unit).
  int64_t add_unit(int64_t root, const std::vector<int64_t>& ids,
                   const std::vector<at::Tensor>& shards, bool keep);

  /// A module of `root` begins its forward. `saves_elsewhere`: another
  /// saved-tensor hook pair is active, so sharc's own sees no save (read
  /// at the outermost scope only; see release_mode_locked). Returns whether
  /// this is the root's outermost scope (where Python pushes its pair).
  bool enter(int64_t root, bool saves_elsewhere);
  /// The innermost module of `root` ends its forward: its scope's holds are
  /// dropped. Returns whether that was the root's outermost scope.
  bool exit(int64_t root);
  /// `module.<name>` read inside a forward: the full tensor the innermost
  /// scope holds, gathering it (blocking; one hold) on its first read
  /// there, and whether this read gathered it. No tensor when no scope of
  /// `root` is open (a read outside forward, which is Python's).
  std::tuple<std::optional<at::Tensor>, bool> read(int64_t root, int64_t id,
                                                    const at::Tensor& shard);

  /// The parameter of `root` whose gathered buffer `saved` lives in (a
  /// tensor autograd saves), or -1. A tied parameter saved in a forward
  /// pass is kept gathered for its backward (see [Note: eager holds]).
  int64_t saved_param(int64_t root, const at::Tensor& saved);
  /// Backward of `root` unpacks a saved handle of `id`: the full tensor,
  /// kept from forward or gathered again (blocking) on the pass's first
  /// unpack, with its backward companions not yet held (see [Note: eager
  /// holds]), and held until the gather's backward ran or backward ends.
  at::Tensor unpack(int64_t root, int64_t id);

  /// A gather unit's forward begins (blocking: one bucketed all-gather,
  /// unless started ahead, and one hold on each of its parameters), and
  /// ends: the holds are dropped, or, for a unit added with `keep` whose
  /// output goes to a backward (`for_backward`), kept until the unit's
  /// backward, which then gathers nothing. Every rank makes the same
  /// choice: it depends on the unit's size and on whether the pass records
  /// a backward, never on routing. A forward recomputed in backward keeps
  /// nothing; a kept unit no backward reached is dropped when the next
  /// forward pass begins.
  void enter_unit(int64_t root, int64_t unit);
  void exit_unit(int64_t root, int64_t unit, bool for_backward);
  /// The gradient of a unit's output arrived: the unit is gathered whole
  /// (once a pass) for its backward, reduced and released at its end.
  void unit_backward(int64_t root, int64_t unit);

  /// The tied parameters and unit members a forward pass kept gathered for
  /// a backward that has not used them yet (any root): counted as kept in
  /// the stats.
  std::set<int64_t> kept_for_backward() const;

  /// The backward of the gather a forward read of `root` made for `id` has
  /// run (its post hook): the backward hold on `id`, if any, is dropped.
  void release_backward_hold(int64_t root, int64_t id);

  /// The backward pass ended (the runtime's end-of-backward callback):
  /// reduces the units (a collective per batch of neighbours, in the same
  /// order on every rank, the next started before the last is waited
  /// for), drops every backward hold and ends the eager prefetch's pass
  /// for each root that gathered for backward.
  void end_backward();

 private:
  struct Unit {
    std::vector<int64_t> ids;
    bool keep = false;  ///< kept from forward to backward (small units)
    /// The nn.Parameters, weakly: the model owns them (and their grads),
    /// and the runtime outlives models.
    std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> shards;
  };
  struct Root {
    ScopeStack<at::Tensor> scopes;
    std::set<int64_t> tied;  ///< held by the outermost scope
    /// Tied parameters autograd saved in the open forward pass: their hold
    /// goes to `backward` when the pass ends, not back to the runtime.
    std::set<int64_t> saved_tied;
    /// Tied parameters a forward pass left held for a backward that has not
    /// unpacked them yet; the next forward pass drops what is left.
    std::set<int64_t> kept_for_backward;
    BackwardHolds<at::Tensor> backward;
    BackwardCompanions companions;  ///< gathered together in backward
    /// Never companions: tied parameters and gather-unit members (kept
    /// here as they are added, not rebuilt at every scope's exit).
    std::set<int64_t> ungrouped;
    bool saves_elsewhere = false;  ///< set at the outermost scope
    std::vector<Unit> units;
    std::vector<int64_t> units_in_backward;  ///< in the order backward reached them
    /// Units a forward pass left gathered for their backward (one hold
    /// on each member), not reached by backward yet.
    std::vector<int64_t> units_kept;
  };

  Root& root_locked(int64_t root);
  /// Gathers `id` for a forward read: the eager gather operator (autograd
  /// wires its gradient to the reduction), whose backward drops the
  /// backward hold.
  at::Tensor gather_for_read(int64_t root, int64_t id, const at::Tensor& shard);
  /// `root` did backward work this pass: the end of backward visits it.
  void note_backward_locked(int64_t root);
  /// Drops one hold (see let_go in eager_scope.cpp).
  void let_go(int64_t root, int64_t id);
  /// The outermost scope of `r` closes: moves its holds on the tied
  /// parameters saved in the pass into the backward holds. Returns them.
  std::set<int64_t> keep_saved_tied_locked(Root& r);
  /// A forward pass begins outside backward: the backward holds and units
  /// an earlier pass kept and no backward took (a forward dropped without
  /// backward, or a unit whose output backward did not reach).
  std::vector<int64_t> drop_unclaimed_locked(Root& r);
  /// `unit` is entered while kept from an earlier pass whose backward never
  /// came, and its shards changed since: the kept buffers hold the old
  /// values, so they are let go and the unit is gathered anew.
  void drop_changed_kept_unit(int64_t root, int64_t unit);
  /// Gathers unit `unit` whole (one hold on each member), after starting
  /// it and the unit ahead of it in `pass`'s order (EagerPrefetch).
  void gather_unit(int64_t root, int64_t unit, EagerPrefetch::UnitPass pass);
  /// A unit's reduction in flight: its shards (for their grads) and token.
  struct UnitReduction {
    std::vector<at::Tensor> shards;
    int64_t token = -1;  ///< -1: nothing to reduce (every member frozen or gone)
  };
  /// The units backward reached, in its order, as batches reduced by one
  /// collective each (see end_backward in eager_scope.cpp).
  std::vector<Unit> batch_units(int64_t root, const std::vector<Unit>& reached);
  /// Starts reducing what the unit's backward held back; finish_unit_reduction
  /// waits for it and adds it into its shards' grads.
  UnitReduction start_unit_reduction(const Unit& unit);
  void finish_unit_reduction(UnitReduction& reduction);
  /// The parameter got a fresh base buffer: key it by the new storage.
  void rekey_locked(int64_t root, int64_t id);

  Runtime& runtime_;
  mutable std::mutex mutex_;
  std::map<int64_t, Root> roots_;
  /// Each parameter's current base storage -> (root, id). The runtime owns
  /// base storages for the life of the parameter, so an address never
  /// names an activation; a buffer handed over is rekeyed at once.
  std::unordered_map<const c10::StorageImpl*, std::pair<int64_t, int64_t>> by_storage_;
  std::vector<int64_t> backward_roots_;  ///< in the order of their first backward work
  std::set<int64_t> warned_kept_;        ///< parameters warned about once
};

}  // namespace sharc
