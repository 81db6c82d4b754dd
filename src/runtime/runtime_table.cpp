#include "sharc/runtime/runtime_table.h"

#include "sharc/core/error.h"

namespace sharc {

RuntimeTable& RuntimeTable::instance() {
  // Never destroyed. A Runtime holds device state: CUDA tensors, pinned
  // header buffers, events and the works of collectives still in flight
  // (gathers started ahead for the next step). A table destroyed with the
  // process's static objects would free them after CUDA, its host allocator
  // or the backend may already be torn down: a process that trained on a
  // GPU and exited normally died in that teardown, after its last line
  // (seen on an H200: SIGSEGV, or an abort on "CUDA error: context is
  // destroyed"). Runtimes whose group was destroyed still go when the
  // table next creates one (forget_destroyed_locked), while all is alive.
  static auto* const table = new RuntimeTable();
  return *table;
}

c10::intrusive_ptr<Runtime> RuntimeTable::get_or_create(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mutex_);
  forget_destroyed_locked();
  auto it = runtimes_.find(group_name);
  if (it != runtimes_.end() && it->second->is_current()) {
    return it->second;
  }
  // First use, or the group was destroyed and a new one took its name.
  auto runtime = c10::make_intrusive<Runtime>(group_name);
  runtimes_[group_name] = runtime;
  return runtime;
}

c10::intrusive_ptr<Runtime> RuntimeTable::get(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = runtimes_.find(group_name);
  SHARC_CHECK(it != runtimes_.end(), "sharc: no runtime for process group '",
              group_name, "'; call sharc.shard(module, group) first");
  return it->second;
}

void RuntimeTable::forget_destroyed_locked() {
  for (auto it = runtimes_.begin(); it != runtimes_.end();) {
    it = it->second->group_alive() ? std::next(it) : runtimes_.erase(it);
  }
}

}  // namespace sharc
