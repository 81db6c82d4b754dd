// What no_sync holds back, as the user's optimizer and zero_grad see it.
//
// [Note: gradients held by no_sync]
// Under no_sync each full gradient is summed into the runtime (`unreduced`;
// with replicate_only, the shard sums in `unreplicated`) and the shards'
// .grad read zeros until a backward outside no_sync reduces the sum (see
// [Note: held back to the end]). Two user actions meet that sum where it
// is not visible:
//   - zero_grad() (an optimizer's or a module's, whatever set_to_none)
//     means "discard what was accumulated": in one process it drops the
//     micro-batches' gradients from .grad, so here it must drop the held
//     sums of those parameters too, or they come back in the next
//     reduction (discard_held_back, called by sharc's zero_grad wrappers);
//   - an optimizer step while sums are held would step on zeros and carry
//     the sums into the next step, silently: the step is refused
//     (held_back names them).
// Both run between backward passes, on parameters every rank holds alike
// (no_sync is used alike), so nothing here is a collective.
//
// A third action is not a call sharc sees: `p.grad = None` (or a .grad
// replaced by another tensor) by hand, which in one process drops what was
// accumulated too. So the end of every backward that leaves a sum held
// records each holder's .grad (`held_beside`, weakly), first making it
// defined (zeros, what it reads anyway): a unit member's .grad is None or
// not depending on this rank's routing, and a record of None could not tell
// a reset apart, so ranks would judge alike-reset parameters differently.
// The next backward's first reduction (or an optimizer step's check, before
// any backward) compares every record with the holder's .grad, once, before
// that backward accumulates into any .grad (a parameter's reduction comes
// before its accumulation): unset or another tensor, and the sum is
// dropped, so the reduction sees the micro-batches since then alone and
// adds into the .grad the user left. A write into .grad in place (zero_(),
// a scale) keeps the tensor and is not seen: .grad reads zeros meanwhile,
// as the held sums are not in it. User code treats every rank's .grad
// alike, so every rank drops alike and the reductions still match.

#include "sharc/runtime/runtime.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

namespace sharc {

std::vector<std::string> Runtime::held_back(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(params_.size())) continue;  // another group's
    ShardedParam& p = param(id);
    if (grad_reset_since_held(p)) drop_held_locked(p);
    if (p.unreduced.defined() || p.unreplicated.defined()) names.push_back(p.name);
  }
  return names;
}

void Runtime::discard_held_back(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(params_.size())) continue;  // another group's
    drop_held_locked(param(id));
  }
}

void Runtime::drop_held_locked(ShardedParam& p) {
  if (p.unreduced.defined()) {
    accounting_.on_unreduced(-static_cast<int64_t>(p.unreduced.nbytes()));
    p.unreduced = at::Tensor();
  }
  if (p.unreplicated.defined()) {
    unreplicated_bytes_ -= static_cast<int64_t>(p.unreplicated.nbytes());
    p.unreplicated = at::Tensor();
  }
  p.held_beside = ShardedParam::HeldBeside{};
}

at::Tensor Runtime::grad_owner(const ShardedParam& p) {
  for (const auto& weak : {p.read_as_shard, p.parameter}) {
    at::Tensor owner = weak ? at::Tensor(weak->lock()) : at::Tensor();
    if (owner.defined()) return owner;
  }
  return p.shard;
}

bool Runtime::grad_reset_since_held(const ShardedParam& p) {
  if (!p.held_beside.recorded || (!p.unreduced.defined() && !p.unreplicated.defined())) {
    return false;
  }
  // A weak reference that no longer locks means the recorded .grad died: it
  // was replaced or unset (its address may be reused, so no compare).
  const at::Tensor& grad = grad_owner(p).grad();
  const c10::intrusive_ptr<c10::TensorImpl> then =
      p.held_beside.grad ? p.held_beside.grad->lock() : c10::intrusive_ptr<c10::TensorImpl>();
  return !(grad.defined() && then && then.get() == grad.unsafeGetTensorImpl());
}

void Runtime::sweep_held_resets_locked() {
  // Once per backward, at its first reduction: before it accumulates into
  // any .grad (each parameter's reduction precedes its accumulation), so
  // what is compared is what the user left. Every record is settled then;
  // the backward's end records afresh.
  const int64_t task = torch::autograd::get_current_graph_task_id();
  if (task == -1 || task == resets_swept_task_) return;
  resets_swept_task_ = task;
  for (auto& owned : params_) {
    ShardedParam& p = *owned;
    if (!p.held_beside.recorded) continue;
    if (grad_reset_since_held(p)) drop_held_locked(p);
    p.held_beside = ShardedParam::HeldBeside{};
  }
}

void Runtime::queue_record_held_locked() {
  queue_once_per_backward_locked(record_held_task_, &Runtime::record_held_beside);
}

void Runtime::record_held_beside() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& owned : params_) {
    ShardedParam& p = *owned;
    // One still recorded was not used in this backward (held from an earlier
    // micro-batch only): its record is the one a reset is measured against.
    if (p.held_beside.recorded) continue;
    if (!p.unreduced.defined() && !p.unreplicated.defined()) continue;
    // A holder's .grad is made defined (zeros, as under no_sync it reads):
    // whether a unit member's .grad is None differs between ranks with
    // their routing, and a record of None could not tell a reset apart.
    const at::Tensor owner = grad_owner(p);
    at::Tensor& grad = owner.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(owner, owner.options().dtype(p.spec.grad_dtype));
    p.held_beside.recorded = true;
    p.held_beside.grad.emplace(grad.getIntrusivePtr());
  }
}

}  // namespace sharc
