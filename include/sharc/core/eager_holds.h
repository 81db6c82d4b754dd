#pragma once
// Which gathered parameters the eager schedule holds, and until when.
//
// [Note: eager holds]
// Forward. The root module and each module that owns sharded parameters
// open a *scope* for the length of their forward. The first read of a
// parameter inside a scope gathers it (one hold on its buffer) and the scope
// keeps the full tensor, so later reads in that scope share the gather and
// its autograd node; closing the scope drops its holds. The innermost scope
// owns a read: a parent that reads a child's parameter holds it for the
// parent's forward. A parameter read in two scopes (a parent and a child)
// is held by both and freed when the last hold goes.
//
// A parameter installed in more than one module (a tied embedding and
// output head) is held by the outermost scope instead, from its first read
// to the end of the forward pass: the modules that read it rarely enclose
// each other, and held by each, it would be gathered, and its gradient
// reduced, once per module. Held by the pass it costs one gather, one
// autograd node (which sums the modules' gradients, as autograd does for
// an unsharded parameter) and one reduction, for the bytes of holding it
// between the reads. Where autograd saved it in the pass (the output head's
// matmul saves its weight), the pass's end hands the hold to backward
// instead of releasing it: the head's backward, usually the first node of
// backward, would gather it again at once, blocking, so keeping it costs
// the bytes from the end of forward to that node and saves a gather a step.
// Every rank saves the same tensors, so every rank keeps alike. A kept
// hold no backward took (a forward pass dropped without backward) is
// dropped when the next forward pass begins outside backward. Until its
// backward, the memory stats count it in kept_gathered_bytes.
//
// Backward. A saved tensor that is (derived from) a gathered parameter is
// kept as a handle, and unpacking it gathers the parameter again: one
// backward hold per parameter and backward pass, shared by every unpack.
// The hold is dropped when the gather's own backward has run (autograd runs
// it after every node that used the parameter) or, for parameters whose
// gradient never reached the gather (frozen ones among them), at the end of
// the backward pass.
//
// Backward companions. Which of a module's parameters autograd saves, the
// order it unpacks them in and the order it runs the module's backward
// nodes in can all depend on the data: an LSTM fed a packed batch whose
// lengths are all equal saves every weight, one fed unequal lengths skips
// the first layer's weight_ih (its input needs no gradient) and unpacks
// weight_hh first. Gathered one by one at their first unpack, the ranks'
// all-gathers would part inside one module. So the parameters one scope
// held (what a module's forward read, the same on every rank) form a group,
// and the first unpack of any member starts one bucketed all-gather of
// every member not held yet, then holds each: every rank issues the same
// gather whichever member its backward reached first, and a member its
// backward never unpacks is let go with the others at the end of backward.
// A group's unsaved members (a Linear's bias) travel in the same
// collective, so the count of collectives is unchanged or lower; the
// price is the bucket's staging copy (a weight alone is gathered straight
// into its buffer), 1.5 MiB more peak on the small benchmark GPT. Groups
// are merged across scopes and passes (a parameter read in two scopes
// joins both), alike on every rank. Tied parameters (held by the pass) and
// gather-unit members (gathered whole by their unit) stay out.
//
// These classes keep the bookkeeping only, whatever the held value is (the
// full tensor in the runtime); the runtime's EagerScope
// (runtime/eager_scope.h) gathers and releases. Not thread-safe: the owner
// locks.

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace sharc {

/// The open forward scopes of one sharded root, innermost last.
template <typename Full>
class ScopeStack {
 public:
  /// Opens a scope; returns whether it is the outermost one.
  bool open() {
    scopes_.emplace_back();
    return scopes_.size() == 1;
  }

  bool is_open() const { return !scopes_.empty(); }
  /// Whether the scope open innermost is the outermost one.
  bool innermost_is_outermost() const { return scopes_.size() == 1; }

  /// What the innermost scope (the outermost one, for `for_pass`) holds
  /// for `id`, or nullptr.
  const Full* find(int64_t id, bool for_pass = false) const {
    if (scopes_.empty()) return nullptr;
    for (const auto& [held, full] : for_pass ? scopes_.front() : scopes_.back()) {
      if (held == id) return &full;
    }
    return nullptr;
  }

  /// The innermost scope (the outermost one, for `for_pass`: held until
  /// the pass ends) takes a hold on `id`, gathered as `full`.
  void hold(int64_t id, Full full, bool for_pass = false) {
    (for_pass ? scopes_.front() : scopes_.back()).emplace_back(id, std::move(full));
  }

  /// Closes the innermost scope (nothing if none is open). Returns the
  /// parameters whose holds it drops, in the order they were taken; the
  /// values are gone by then, so only references from outside remain when
  /// the caller releases them.
  std::vector<int64_t> close() {
    std::vector<int64_t> ids;
    if (scopes_.empty()) return ids;
    for (const auto& entry : scopes_.back()) ids.push_back(entry.first);
    scopes_.pop_back();
    return ids;
  }

 private:
  std::vector<std::vector<std::pair<int64_t, Full>>> scopes_;
};

/// The parameters one sharded root holds gathered for the backward pass.
template <typename Full>
class BackwardHolds {
 public:
  /// What is held for `id`, or nullptr.
  const Full* find(int64_t id) const {
    auto it = held_.find(id);
    return it == held_.end() ? nullptr : &it->second;
  }

  void hold(int64_t id, Full full) { held_.emplace(id, std::move(full)); }

  /// Drops `id`'s hold; returns whether there was one (the gather's
  /// backward runs once per pass, the end of backward may come after it).
  bool drop(int64_t id) { return held_.erase(id) > 0; }

  /// Drops every hold; returns their parameters, in id order.
  std::vector<int64_t> drop_all() {
    std::vector<int64_t> ids;
    for (const auto& entry : held_) ids.push_back(entry.first);
    held_.clear();
    return ids;
  }

  bool empty() const { return held_.empty(); }

 private:
  std::map<int64_t, Full> held_;
};

/// The backward companions of one sharded root (see [Note: eager holds]).
class BackwardCompanions {
 public:
  /// A scope that held `held` closes: they form a group (merged with the
  /// groups they are already in). `outside`: never grouped.
  void close_scope(const std::vector<int64_t>& held, const std::set<int64_t>& outside) {
    if (already_grouped(held, outside)) return;  // every pass after the first
    std::set<int64_t> group;
    for (int64_t id : held) {
      if (outside.count(id) > 0) continue;
      group.insert(id);
      auto it = groups_.find(id);
      if (it != groups_.end()) group.insert(it->second.begin(), it->second.end());
    }
    if (group.size() < 2) return;
    const std::vector<int64_t> members(group.begin(), group.end());
    for (int64_t id : members) groups_[id] = members;
  }
  /// What backward gathers with `id`, in id order (`id` included).
  std::vector<int64_t> with(int64_t id) const {
    auto it = groups_.find(id);
    return it == groups_.end() ? std::vector<int64_t>{id} : it->second;
  }

 private:
  /// Whether every grouped id of `held` is in one group already (this runs
  /// at every module exit of every step: no allocation when nothing changes).
  bool already_grouped(const std::vector<int64_t>& held,
                       const std::set<int64_t>& outside) const {
    const std::vector<int64_t>* group = nullptr;
    size_t count = 0;
    for (int64_t id : held) {
      if (outside.count(id) > 0) continue;
      if (++count > 1 && group == nullptr) return false;  // the first one had no group
      if (group == nullptr) {
        auto it = groups_.find(id);
        if (it == groups_.end()) continue;  // ungrouped: fine only if it is the only one
        group = &it->second;
      }
      if (!std::binary_search(group->begin(), group->end(), id)) return false;
    }
    return true;
  }

  std::map<int64_t, std::vector<int64_t>> groups_;
};

}  // namespace sharc
