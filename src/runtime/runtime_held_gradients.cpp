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

#include "sharc/runtime/runtime.h"

namespace sharc {

std::vector<std::string> Runtime::held_back(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(params_.size())) continue;  // another group's
    const ShardedParam& p = param(id);
    if (p.unreduced.defined() || p.unreplicated.defined()) names.push_back(p.name);
  }
  return names;
}

void Runtime::discard_held_back(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(params_.size())) continue;  // another group's
    ShardedParam& p = param(id);
    if (p.unreduced.defined()) {
      accounting_.on_unreduced(-static_cast<int64_t>(p.unreduced.nbytes()));
      p.unreduced = at::Tensor();
    }
    if (p.unreplicated.defined()) {
      unreplicated_bytes_ -= static_cast<int64_t>(p.unreplicated.nbytes());
      p.unreplicated = at::Tensor();
    }
  }
}

}  // namespace sharc
