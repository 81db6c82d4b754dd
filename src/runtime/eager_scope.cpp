// The eager path's owner of gathered parameters: see eager_scope.h and
// [Note: eager holds].

#include "sharc/runtime/eager_scope.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include "sharc/core/error.h"
#include "sharc/runtime/runtime.h"

namespace sharc {
namespace {

using torch::autograd::variable_list;

/// Runs after the gather's backward (which autograd orders after every
/// node that used the parameter): the backward hold can go.
class DropBackwardHold : public torch::autograd::FunctionPostHook {
 public:
  DropBackwardHold(c10::weak_intrusive_ptr<Runtime> runtime, int64_t root, int64_t id)
      : runtime_(std::move(runtime)), root_(root), id_(id) {}

  variable_list operator()(const variable_list& outputs,
                           const variable_list& /*inputs*/) override {
    if (auto runtime = runtime_.lock()) runtime->eager_scope().release_backward_hold(root_, id_);
    return outputs;
  }

  // Compiled autograd asks every hook to describe itself before running
  // the backward; torch's default answer names only this class. The eager
  // schedule's backward (re-gathers from saved-tensor hooks, reductions
  // from these hooks) is not one compiled autograd can capture, so the
  // refusal names the cause and the ways out instead.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false,
        "sharc: compiled autograd (torch._dynamo.compiled_autograd._enable, or "
        "torch._dynamo.config.compiled_autograd = True) cannot capture the backward of a "
        "sharded model's eager forward (or of its code between compiled graphs): sharc "
        "re-gathers its parameters and reduces its gradients there from hooks. Run this "
        "backward without compiled autograd; torch.compile(model, backend=\"sharc\") "
        "compiles and schedules the backward itself.");
  }

 private:
  c10::weak_intrusive_ptr<Runtime> runtime_;
  int64_t root_;
  int64_t id_;
};

// Without the checks of Tensor::storage(), which throws for tensors whose
// storage must not be accessed (functorch's wrappers): those are nobody's
// gathered buffer.
const c10::StorageImpl* storage_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

}  // namespace

EagerScope::Root& EagerScope::root_locked(int64_t root) {
  auto it = roots_.find(root);
  SHARC_CHECK(it != roots_.end(), "sharc: no sharded root ", root, " in group '",
              runtime_.group_name(), "'");
  return it->second;
}

void EagerScope::add_root(int64_t root, const std::vector<int64_t>& ids,
                          const std::vector<int64_t>& tied) {
  std::vector<const c10::StorageImpl*> storages;
  for (int64_t id : ids) storages.push_back(storage_of(runtime_.padded_base(id)));
  std::lock_guard<std::mutex> lock(mutex_);
  roots_[root].tied.insert(tied.begin(), tied.end());
  roots_[root].ungrouped.insert(tied.begin(), tied.end());
  for (size_t i = 0; i < ids.size(); ++i) by_storage_[storages[i]] = {root, ids[i]};
}

int64_t EagerScope::add_unit(int64_t root, const std::vector<int64_t>& ids,
                             const std::vector<at::Tensor>& shards, bool keep) {
  SHARC_CHECK(ids.size() == shards.size(), "sharc: a gather unit of ", ids.size(),
              " parameters given ", shards.size(), " shards");
  std::lock_guard<std::mutex> lock(mutex_);
  Root& r = root_locked(root);
  Unit unit{ids, keep, {}};
  for (const at::Tensor& shard : shards) unit.shards.emplace_back(shard.getIntrusivePtr());
  r.ungrouped.insert(ids.begin(), ids.end());
  r.units.push_back(std::move(unit));
  return static_cast<int64_t>(r.units.size()) - 1;
}

// -- forward scopes ---------------------------------------------------------

bool EagerScope::enter(int64_t root, bool saves_elsewhere) {
  bool outermost = false;
  std::vector<int64_t> unclaimed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    outermost = r.scopes.open();
    if (outermost) {
      r.saves_elsewhere = saves_elsewhere;
      r.saved_tied.clear();
      // A forward recomputed in backward (checkpointing) is part of that
      // backward, which may still unpack what its forward kept.
      if (torch::autograd::get_current_graph_task_id() == -1) unclaimed = drop_unclaimed_locked(r);
    }
  }
  for (int64_t id : unclaimed) let_go(root, id);
  if (outermost) runtime_.begin_eager_forward();
  runtime_.eager_reduction().enter_module(root);
  runtime_.eager_prefetch().enter_module(root);
  return outermost;
}

bool EagerScope::exit(int64_t root) {
  std::vector<int64_t> held;
  bool outermost = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    if (!r.scopes.is_open()) return false;  // a second exit: nothing to drop
    const std::set<int64_t> kept =
        r.scopes.innermost_is_outermost() ? keep_saved_tied_locked(r) : std::set<int64_t>{};
    held = r.scopes.close();  // the scope's tensors go first: only outside references remain
    r.companions.close_scope(held, r.ungrouped);
    held.erase(std::remove_if(held.begin(), held.end(),
                              [&](int64_t id) { return kept.count(id) > 0; }),
               held.end());
    outermost = !r.scopes.is_open();
  }
  for (int64_t id : held) let_go(root, id);
  runtime_.eager_reduction().exit_module();
  runtime_.eager_prefetch().exit_module();
  if (outermost) {
    std::lock_guard<std::mutex> lock(mutex_);
    root_locked(root).saves_elsewhere = false;
  }
  return outermost;
}

std::tuple<std::optional<at::Tensor>, bool> EagerScope::read(int64_t root, int64_t id,
                                                             const at::Tensor& shard) {
  bool for_pass = false;  // tied: the outermost scope holds it (fixed at add_root)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    if (!r.scopes.is_open()) return {std::nullopt, false};
    for_pass = r.tied.count(id) > 0;
    if (const at::Tensor* full = r.scopes.find(id, for_pass)) return {*full, false};
  }
  at::Tensor full = gather_for_read(root, id, shard);
  std::lock_guard<std::mutex> lock(mutex_);
  root_locked(root).scopes.hold(id, full, for_pass);
  return {full, true};
}

at::Tensor EagerScope::gather_for_read(int64_t root, int64_t id, const at::Tensor& shard) {
  // Through the dispatcher, autograd included: its gradient is reduced in
  // buckets (eager_reduction.h), and dispatch modes see the read.
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sharc::gather", "")
                       .typed<at::Tensor(const at::Tensor&, c10::IntArrayRef,
                                         const std::string&, int64_t)>();
  at::Tensor full = op.call(shard, runtime_.shape(id), runtime_.group_name(), id);
  if (const auto& node = full.grad_fn()) {
    node->add_post_hook(std::make_unique<DropBackwardHold>(runtime_.weak_self(), root, id));
  }
  return full;
}

// -- backward ---------------------------------------------------------------

int64_t EagerScope::saved_param(int64_t root, const at::Tensor& saved) {
  const c10::StorageImpl* storage = storage_of(saved);
  if (storage == nullptr) return -1;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_storage_.find(storage);
  if (it == by_storage_.end() || it->second.first != root) return -1;
  const int64_t id = it->second.second;
  Root& r = root_locked(root);
  if (r.tied.count(id) > 0 && r.scopes.is_open()) r.saved_tied.insert(id);
  return id;
}

// [Note: eager holds] (tied parameters kept for backward): every rank
// saves the same tensors in a pass, so every rank keeps the same ones and
// skips the same backward gather.
std::set<int64_t> EagerScope::keep_saved_tied_locked(Root& r) {
  std::set<int64_t> kept;
  for (int64_t id : r.saved_tied) {
    const at::Tensor* full = r.scopes.find(id, /*for_pass=*/true);
    if (full == nullptr || r.backward.find(id) != nullptr) continue;
    r.backward.hold(id, *full);
    r.kept_for_backward.insert(id);
    kept.insert(id);
  }
  r.saved_tied.clear();
  return kept;
}

std::set<int64_t> EagerScope::kept_for_backward() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::set<int64_t> kept;
  for (const auto& [root, r] : roots_) {
    for (int64_t id : r.kept_for_backward) {
      if (r.backward.find(id) != nullptr) kept.insert(id);
    }
    for (int64_t unit : r.units_kept) {
      const std::vector<int64_t>& ids = r.units.at(static_cast<size_t>(unit)).ids;
      kept.insert(ids.begin(), ids.end());
    }
  }
  return kept;
}

std::vector<int64_t> EagerScope::drop_unclaimed_locked(Root& r) {
  std::vector<int64_t> dropped;
  for (int64_t id : r.kept_for_backward) {
    if (r.backward.drop(id)) dropped.push_back(id);
  }
  r.kept_for_backward.clear();
  for (int64_t unit : r.units_kept) {  // one hold on each member
    const std::vector<int64_t>& ids = r.units.at(static_cast<size_t>(unit)).ids;
    dropped.insert(dropped.end(), ids.begin(), ids.end());
  }
  r.units_kept.clear();
  return dropped;
}

at::Tensor EagerScope::unpack(int64_t root, int64_t id) {
  std::optional<at::Tensor> kept;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    const at::Tensor* full = r.backward.find(id);
    if (full != nullptr && r.kept_for_backward.erase(id) == 0) return *full;
    if (full != nullptr) {  // kept from forward: this backward ends its hold
      kept = *full;
      note_backward_locked(root);
    }
  }
  if (kept.has_value()) {
    runtime_.queue_end_of_backward();
    return *kept;
  }
  std::vector<int64_t> ids;  // `id` and its companions not held yet, in id order
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Root& r = root_locked(root);
    for (int64_t other : r.companions.with(id)) {
      if (other == id || r.backward.find(other) == nullptr) ids.push_back(other);
    }
  }
  // Recorded for the next backward's prefetch, which may start its group.
  for (int64_t gathered : ids) runtime_.eager_prefetch().on_backward_gather(root, gathered);
  if (ids.size() > 1) runtime_.start_gather(ids);  // one bucketed collective
  at::Tensor unpacked;
  for (int64_t gathered : ids) {
    at::Tensor full = runtime_.gather(gathered);
    std::lock_guard<std::mutex> lock(mutex_);
    root_locked(root).backward.hold(gathered, full);
    note_backward_locked(root);
    if (gathered == id) unpacked = full;
  }
  runtime_.queue_end_of_backward();
  return unpacked;
}

void EagerScope::note_backward_locked(int64_t root) {
  if (std::find(backward_roots_.begin(), backward_roots_.end(), root) == backward_roots_.end()) {
    backward_roots_.push_back(root);
  }
}

void EagerScope::release_backward_hold(int64_t root, int64_t id) {
  bool dropped = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped = root_locked(root).backward.drop(id);
  }
  if (dropped) let_go(root, id);
}

// -- gather units -----------------------------------------------------------

void EagerScope::enter_unit(int64_t root, int64_t unit) {
  // A forward recomputed in backward (checkpointing) is not the forward
  // pass the unit order follows.
  const bool recomputed = torch::autograd::get_current_graph_task_id() != -1;
  drop_changed_kept_unit(root, unit);
  gather_unit(root, unit, recomputed ? EagerPrefetch::UnitPass::kPlain
                                     : EagerPrefetch::UnitPass::kForward);
}

// The next forward pass's first scope drops what an earlier one kept
// (drop_unclaimed_locked), but a unit can be entered before any scope of
// its root opens (the root itself as the unit, a unit called directly) or
// with none opening eagerly at all (a compiled root). Every rank writes
// the same shards, so every rank drops alike.
void EagerScope::drop_changed_kept_unit(int64_t root, int64_t unit) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    if (std::find(r.units_kept.begin(), r.units_kept.end(), unit) == r.units_kept.end()) return;
    ids = r.units.at(static_cast<size_t>(unit)).ids;
  }
  if (std::none_of(ids.begin(), ids.end(),
                   [&](int64_t id) { return runtime_.shard_changed_since_gather(id); })) {
    return;  // the same values: the kept hold serves this pass too
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t>& kept = root_locked(root).units_kept;
    auto it = std::find(kept.begin(), kept.end(), unit);
    if (it == kept.end()) return;
    kept.erase(it);
  }
  for (int64_t id : ids) let_go(root, id);
}

void EagerScope::gather_unit(int64_t root, int64_t unit, EagerPrefetch::UnitPass pass) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ids = root_locked(root).units.at(static_cast<size_t>(unit)).ids;
  }
  runtime_.eager_prefetch().start_unit(root, unit, ids, pass);
  runtime_.wait_gather(ids);
}

void EagerScope::exit_unit(int64_t root, int64_t unit, bool for_backward) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    const Unit& u = r.units.at(static_cast<size_t>(unit));
    ids = u.ids;
    const bool recomputed = torch::autograd::get_current_graph_task_id() != -1;
    std::vector<int64_t>& kept = r.units_kept;
    if (u.keep && for_backward && !recomputed &&
        std::find(kept.begin(), kept.end(), unit) == kept.end()) {
      kept.push_back(unit);  // this hold is the backward's now
      return;
    }
  }
  for (int64_t id : ids) let_go(root, id);
}

void EagerScope::unit_backward(int64_t root, int64_t unit) {
  bool kept = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Root& r = root_locked(root);
    const std::vector<int64_t>& reached = r.units_in_backward;
    if (std::find(reached.begin(), reached.end(), unit) != reached.end()) return;
    auto it = std::find(r.units_kept.begin(), r.units_kept.end(), unit);
    if (it != r.units_kept.end()) {  // its forward hold is this backward's
      r.units_kept.erase(it);
      kept = true;
    }
  }
  // Gathered whole, at the same point on every rank.
  if (!kept) gather_unit(root, unit, EagerPrefetch::UnitPass::kBackward);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    root_locked(root).units_in_backward.push_back(unit);
    note_backward_locked(root);
  }
  runtime_.queue_end_of_backward();
}

// The units' reductions run at the end of backward, where no compute is
// left to hide them: a collective per unit paid a collective's latency per
// unit (on the host, most of a small unit's time). Neighbours in backward's
// order share one instead, a batch closing once its full gradients reach
// the eager bucket size (ShardConfig.eager_reduce_bucket_bytes; 0: a unit
// each). Bucketing changes no sum: every element is still summed over the
// ranks in rank order.
std::vector<EagerScope::Unit> EagerScope::batch_units(int64_t root,
                                                      const std::vector<Unit>& reached) {
  const int64_t limit = runtime_.eager_reduction().bucket_bytes(root);
  std::vector<Unit> batches;
  int64_t bytes = 0;
  for (const Unit& unit : reached) {
    if (batches.empty() || bytes >= limit) {
      batches.emplace_back();
      bytes = 0;
    }
    Unit& batch = batches.back();
    batch.ids.insert(batch.ids.end(), unit.ids.begin(), unit.ids.end());
    batch.shards.insert(batch.shards.end(), unit.shards.begin(), unit.shards.end());
    for (int64_t id : unit.ids) {
      int64_t numel = 1;
      for (int64_t size : runtime_.shape(id)) numel *= size;
      bytes += numel * static_cast<int64_t>(c10::elementSize(runtime_.spec(id).reduce_dtype));
    }
  }
  return batches;
}

EagerScope::UnitReduction EagerScope::start_unit_reduction(const Unit& unit) {
  std::vector<int64_t> ids;
  UnitReduction reduction;
  for (size_t i = 0; i < unit.ids.size(); ++i) {
    at::Tensor shard(unit.shards[i].lock());
    if (!shard.defined() || !shard.requires_grad()) continue;  // gone, or frozen
    ids.push_back(unit.ids[i]);
    reduction.shards.push_back(shard);
  }
  if (!ids.empty()) reduction.token = runtime_.flush_unit(ids);
  return reduction;
}

void EagerScope::finish_unit_reduction(UnitReduction& reduction) {
  if (reduction.token < 0) return;
  std::vector<at::Tensor> grads = runtime_.wait_reduce_scatter(reduction.token);
  for (size_t i = 0; i < grads.size(); ++i) Runtime::add_into_grad(reduction.shards[i], grads[i]);
  reduction = UnitReduction{};
}

void EagerScope::end_backward() {
  std::vector<int64_t> roots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    roots.swap(backward_roots_);
  }
  for (int64_t root : roots) {
    std::vector<int64_t> units;
    std::vector<Unit> reached;
    std::vector<int64_t> held;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Root& r = root_locked(root);
      units.swap(r.units_in_backward);
      for (int64_t unit : units) reached.push_back(r.units.at(static_cast<size_t>(unit)));
      held = r.backward.drop_all();
    }
    // In the same order on every rank, one collective per batch of units,
    // each started before the one before it is waited for: two in flight
    // at most (their buckets are what it costs), not one wait per batch.
    const std::vector<Unit> batches = batch_units(root, reached);
    UnitReduction in_flight;
    for (size_t i = 0; i <= batches.size(); ++i) {
      UnitReduction next = i < batches.size() ? start_unit_reduction(batches[i]) : UnitReduction{};
      if (i > 0) {
        finish_unit_reduction(in_flight);
        for (int64_t id : batches[i - 1].ids) let_go(root, id);
      }
      in_flight = std::move(next);
    }
    for (int64_t id : held) let_go(root, id);
    runtime_.eager_prefetch().end_backward(root);
  }
}

// -- letting go -------------------------------------------------------------

// Drops one hold. A buffer something outside still references when its last
// hold goes (a kept `module.weight`, a view, a numpy array) is handed to
// those references rather than freed under them, with a warning once per
// parameter. While another saved-tensor hook pair keeps the forward's saves
// (activation checkpointing's recomputation keeps detached aliases, which
// handed-out tracking cannot see), every buffer is handed over, quietly:
// that is the pair's design, not a user's kept reference.
void EagerScope::let_go(int64_t root, int64_t id) {
  bool quiet = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    quiet = root_locked(root).saves_elsewhere;
  }
  const ReleaseMode mode = quiet ? ReleaseMode::kHandOver : ReleaseMode::kFreeOrHandOver;
  if (!runtime_.release(id, mode)) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    rekey_locked(root, id);
    if (quiet || !warned_kept_.insert(id).second) return;
  }
  TORCH_WARN("sharc: the gathered parameter '", runtime_.name(id),
             "' was still referenced when sharc released it (a `module.weight` kept past its "
             "module's forward, or a view or array of it). That reference keeps the values of "
             "that gather, and their memory, until it is dropped; it does not follow later "
             "updates. Read the module attribute again instead of keeping it.");
}

void EagerScope::rekey_locked(int64_t root, int64_t id) {
  for (auto it = by_storage_.begin(); it != by_storage_.end();) {
    it = it->second.second == id ? by_storage_.erase(it) : std::next(it);
  }
  by_storage_[storage_of(runtime_.padded_base(id))] = {root, id};
}

}  // namespace sharc
