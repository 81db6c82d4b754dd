// Eager prefetch: see [Note: eager prefetch] in eager_prefetch.h.

#include "sharc/runtime/eager_prefetch.h"

#include <algorithm>

#include "sharc/runtime/runtime.h"

namespace sharc {

void EagerPrefetch::configure(int64_t root, bool enabled, const std::vector<int64_t>& excluded) {
  std::lock_guard<std::mutex> lock(mutex_);
  Root& r = roots_[root];
  r.enabled = enabled;
  for (int64_t id : excluded) {
    r.forward.exclude(id);
    r.backward.exclude(id);
  }
}

void EagerPrefetch::enter_module(int64_t root) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_.emplace_back(root, next_module_++);
}

void EagerPrefetch::exit_module() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.empty()) return;
  const int64_t root = open_.back().first;
  open_.pop_back();
  const bool root_open = std::any_of(open_.begin(), open_.end(),
                                     [root](const auto& m) { return m.first == root; });
  auto it = roots_.find(root);
  if (!root_open && it != roots_.end()) end_pass_locked(it->second.forward);
}

void EagerPrefetch::on_forward_gather(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.empty()) return;
  const auto [root, module] = open_.back();
  auto it = roots_.find(root);
  if (it == roots_.end() || !it->second.enabled) return;
  read_locked(it->second.forward, module, id);
}

void EagerPrefetch::on_backward_gather(int64_t root, int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = roots_.find(root);
  if (it == roots_.end() || !it->second.enabled) return;
  // Grouped by the parameter's forward group: backward asks for one
  // module's parameters together, in its own order.
  Root& r = it->second;
  read_locked(r.backward, r.forward.step_of(id), id);
}

void EagerPrefetch::end_backward(int64_t root) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = roots_.find(root);
  if (it == roots_.end()) return;
  end_pass_locked(it->second.backward);
  end_pass_locked(it->second.unit_forward);
  end_pass_locked(it->second.unit_backward);
}

void EagerPrefetch::start_unit(int64_t root, int64_t unit, const std::vector<int64_t>& ids,
                               UnitPass pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = roots_.find(root);
  if (pass == UnitPass::kPlain || it == roots_.end() || !it->second.enabled) {
    runtime_.start_gather(ids);
    return;
  }
  GatherOrder& order =
      pass == UnitPass::kForward ? it->second.unit_forward : it->second.unit_backward;
  runtime_.give_up_changed_ahead(order);
  const GatherBucket bucket{ids};
  apply_locked(order.gather(unit, bucket));
  runtime_.start_gather(ids);  // unless it was in flight already
  apply_locked(order.reached(ids));
}

void EagerPrefetch::read_locked(GatherOrder& order, int64_t step, int64_t id) {
  apply_locked(order.gather(step, GatherBucket{{id}}));
  apply_locked(order.reached({id}));
}

void EagerPrefetch::apply_locked(const GatherOrder::Decision& decision) {
  if (!decision.give_up.empty()) runtime_.drop_unheld(decision.give_up);
  for (const GatherBucket& bucket : decision.start) runtime_.start_gather(bucket.ids);
}

void EagerPrefetch::end_pass_locked(GatherOrder& order) {
  // What the pass gathered ahead and nobody took is freed.
  const std::vector<int64_t> left = order.end_pass();
  if (!left.empty()) runtime_.drop_unheld(left);
}

}  // namespace sharc
