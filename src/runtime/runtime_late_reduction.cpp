// Late reduction waits: a compiled backward graph's reduce-scatter finishing
// after the graph returns. The wait_reduce_scatter op of a compiled backward
// graph calls wait_reduce_scatter_in_graph; this file decides where the wait
// goes and delivers what was left behind.
//
// [Note: late reduction waits]
// A compiled backward graph starts its gradients' reduce-scatter and waits
// for it before it returns the shard gradients, its outputs. Where a wait
// blocks the host (the host's collectives: gloo), the collective then
// overlaps only the rest of its own graph, and on a model split by graph
// breaks each small backward graph waits for its own reduction, with the
// ranks meeting at every one of them, while the next graph's compute could
// have run. So, inside a backward pass that accumulates every gradient into
// .grad, the wait returns zero shard gradients at once (autograd adds them
// into .grad) and the reduction stays in flight behind the graph. It is
// waited, and its shard gradients added into .grad of the tensors the
// gathers read as the shards (the user's parameters), at the end of the
// backward pass (an autograd engine callback, before backward() returns),
// or sooner, oldest first, when the reductions in flight hold more than
// kLateReductionWindowBytes: their gloo inputs stay alive until waited.
// Delivery order never changes a sum's value: one reduction per gradient
// per graph, added as autograd would have.
//
// The wait stays in the graph, as compiled, where finishing later would be
// wrong or buys nothing:
//   - the gradients are on a device: a wait there orders streams and does
//     not block the host;
//   - the group all-reduces over replicas too (hybrid): the all-reduce
//     starts at the wait;
//   - outside the autograd engine, or in a pass that computes some
//     gradients only (autograd.grad, backward(inputs=...)): they are the
//     graph's outputs, nothing goes to .grad;
//   - a parameter of the bucket has a gradient hook or a post-accumulate
//     hook, or is no longer alive: the hook would see the zeros.
// Every rank waits each reduction once, and a wait only blocks: where the
// ranks wait does not change what they send, so ranks may decide
// differently (a hook on one rank only) without diverging.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "sharc/core/error.h"
#include "sharc/runtime/runtime.h"

#include <iterator>

namespace sharc {
namespace {

// A leaf parameter whose .grad a late reduction may add into: nothing of
// the user's sees its gradient before it lands there.
bool takes_late_gradient(const at::Tensor& shard) {
  if (!shard.defined() || !shard.requires_grad() || !shard.is_leaf()) return false;
  return torch::autograd::impl::hooks(shard).empty() &&
         !torch::autograd::impl::post_acc_grad_hooks(shard);
}

// A backward pass that accumulates into .grad: inside the engine, and not
// limited to some inputs (autograd.grad and backward(inputs=) mark what
// they compute; a plain backward marks nothing).
bool in_accumulating_backward() {
  if (torch::autograd::get_current_graph_task_id() == -1) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info != nullptr && exec_info->empty();
}

}  // namespace

std::vector<at::Tensor> Runtime::wait_reduce_scatter_in_graph(int64_t token) {
  std::vector<at::Tensor> zeros;
  std::vector<LateReduction> due;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reductions_.find(token);
    if (it == reductions_.end() || !may_finish_late_locked(it->second) ||
        !queue_late_delivery_locked()) {
      // Waited here, as compiled (an unknown token raises there).
    } else {
      const PendingReduction& pending = it->second;
      LateReduction late{token, 0, {}, {}};
      for (size_t i = 0; i < pending.widths.size(); ++i) {
        zeros.push_back(at::zeros({pending.widths[i]},
                                  pending.out.options().dtype(pending.dtypes[i])));
        late.zeros.emplace_back(zeros.back().storage().getWeakStorageImpl());
        late.zero_versions.push_back(zeros.back()._version());
      }
      late.bytes = static_cast<int64_t>(pending.input.nbytes() + pending.wire.nbytes());
      const int64_t bytes = late.bytes;
      late_reductions_.push_back(std::move(late));
      late_reduction_bytes_ += bytes;
      accounting_.on_late_reduction();
      // The newest stays in flight whatever it weighs: it was just started.
      while (late_reduction_bytes_ > kLateReductionWindowBytes && late_reductions_.size() > 1) {
        due.push_back(std::move(late_reductions_.front()));
        late_reduction_bytes_ -= due.back().bytes;
        late_reductions_.pop_front();
      }
    }
  }
  if (zeros.empty()) return wait_reduce_scatter(token);
  for (const LateReduction& late : due) deliver_late(late);
  return zeros;
}

// Called with mutex_ held.
bool Runtime::may_finish_late_locked(const PendingReduction& pending) {
  if (!pending.work || !pending.input.defined() || !pending.input.is_cpu()) return false;
  if (replicate_ || !in_accumulating_backward()) return false;
  for (size_t i = 0; i < pending.ids.size(); ++i) {
    if (pending.held[i]) continue;  // comes back zero and is reduced elsewhere
    const ShardedParam& p = param(pending.ids[i]);
    if (!p.read_as_shard) return false;
    if (!takes_late_gradient(at::Tensor(p.read_as_shard->lock()))) return false;
  }
  return true;
}

// Called with mutex_ held. Queues deliver_late_reductions() at the end of
// the current autograd graph task, once per task; false where the engine
// takes no callback (not inside it).
bool Runtime::queue_late_delivery_locked() {
  return queue_once_per_backward_locked(late_delivery_task_, &Runtime::deliver_late_reductions);
}

void Runtime::deliver_late_reductions() {
  for (const LateReduction& late : take_late_reductions()) deliver_late(late);
}

void Runtime::drop_late_reductions() {
  if (torch::autograd::get_current_graph_task_id() != -1) return;  // recomputed in backward
  for (const LateReduction& late : take_late_reductions()) wait_reduce_scatter(late.token);
}

// Every reduction left in flight, oldest first; none is left after.
std::vector<Runtime::LateReduction> Runtime::take_late_reductions() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LateReduction> taken(std::make_move_iterator(late_reductions_.begin()),
                                   std::make_move_iterator(late_reductions_.end()));
  late_reductions_.clear();
  late_reduction_bytes_ = 0;
  late_delivery_task_ = -1;
  return taken;
}

// [Note: late gradients written in place]
// Where nothing accumulated into a parameter's .grad before, the engine
// takes the zeros handed out as the .grad itself (it steals a gradient
// nobody else holds). If that .grad is still those zeros, untouched (its
// version unchanged, so no other graph of the pass added into it), the
// reduced values are written straight into it: the same values an add
// would give, without a shard gradient of its own and a pass to add it.
// Any other .grad (one from an earlier backward, a copy the engine made,
// zeros another graph added into) gets the add. A write the version counter
// does not see (through .data, or a numpy view) between the engine taking
// the zeros and the delivery would be overwritten, not added to.
std::vector<at::Tensor> Runtime::untouched_zero_grads(const LateReduction& late,
                                                      const std::vector<at::Tensor>& targets) const {
  std::vector<at::Tensor> into(targets.size());
  for (size_t i = 0; i < targets.size() && i < late.zeros.size(); ++i) {
    if (!targets[i].defined()) continue;
    const at::Tensor& grad = targets[i].grad();
    // The engine keeps a detached alias of what it steals: same storage
    // and version counter, another tensor.
    if (!grad.defined() || !grad.has_storage() || grad.storage_offset() != 0 ||
        !grad.is_contiguous()) {
      continue;
    }
    const auto zeros = late.zeros[i].lock();
    if (!zeros || grad.storage().unsafeGetStorageImpl() != zeros.get()) continue;
    if (grad._version() != late.zero_versions[i]) continue;
    into[i] = grad;
  }
  return into;
}

// Waits the reduction of `late` and adds its shard gradients into .grad of
// the tensors its parameters' gathers read (see may_finish_late_locked).
void Runtime::deliver_late(const LateReduction& late) {
  std::vector<int64_t> ids;
  std::vector<bool> held;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = reductions_.find(late.token);
    SHARC_CHECK(it != reductions_.end(), "sharc: the late reduce-scatter of token ", late.token,
                " in group '", comm_.group_name(), "' was waited on already; this is a sharc bug");
    ids = it->second.ids;
    held = it->second.held;
  }
  std::vector<at::Tensor> targets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < ids.size(); ++i) {
      const ShardedParam& p = param(ids[i]);
      targets.push_back(held[i] || !p.read_as_shard ? at::Tensor()
                                                     : at::Tensor(p.read_as_shard->lock()));
    }
  }
  const std::vector<at::Tensor> into = untouched_zero_grads(late, targets);
  const std::vector<at::Tensor> shards = wait_reduce_scatter(late.token, into);
  for (size_t i = 0; i < ids.size(); ++i) {
    // Held back, or the parameter is gone: nothing to add.
    if (!targets[i].defined()) continue;
    if (into[i].defined()) {
      into[i].unsafeGetTensorImpl()->bump_version();  // written in place, outside autograd
      std::lock_guard<std::mutex> lock(mutex_);
      accounting_.on_late_grad_in_place();
    } else {
      add_into_grad(targets[i], shards[i]);
    }
  }
}

}  // namespace sharc
