// Eager prefetch: see eager_prefetch.h and [Note: eager prefetch].

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
  if (!root_open && it != roots_.end()) finish_locked(it->second.forward);
}

void EagerPrefetch::on_forward_gather(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.empty()) return;
  const auto [root, module] = open_.back();
  auto it = roots_.find(root);
  if (it == roots_.end() || !it->second.enabled) return;
  start_locked(it->second.forward.on_gather(module, id));
}

void EagerPrefetch::on_backward_gather(int64_t root, int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = roots_.find(root);
  if (it == roots_.end() || !it->second.enabled) return;
  // Grouped by the parameter's forward group: backward asks for one
  // module's parameters together, in its own order.
  Root& r = it->second;
  start_locked(r.backward.on_gather(r.forward.group_of(id), id));
}

void EagerPrefetch::end_backward(int64_t root) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = roots_.find(root);
  if (it != roots_.end()) finish_locked(it->second.backward);
}

void EagerPrefetch::start_locked(const std::vector<std::vector<int64_t>>& groups) {
  for (const std::vector<int64_t>& ids : groups) runtime_.start_gather(ids);
}

void EagerPrefetch::finish_locked(PassRecording& pass) {
  // What the pass gathered ahead and nobody took is freed.
  const std::vector<int64_t> touched = pass.finish();
  if (!touched.empty()) runtime_.drop_unheld(touched);
}

}  // namespace sharc
