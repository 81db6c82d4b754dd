#pragma once
// Eager prefetch, the runtime's side: which groups of parameters to gather
// ahead, for each sharded root, from the order its last pass of each kind
// gathered them in (see [Note: eager prefetch] in core/pass_recording.h).
//
// Python reports events only: a module's forward begins or ends, backward
// gathers a parameter again, backward ended. The forward's own reads reach
// here from the gather operator itself.

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "sharc/core/pass_recording.h"

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

 private:
  struct Root {
    bool enabled = true;
    PassRecording forward;
    PassRecording backward;
  };
  void start_locked(const std::vector<std::vector<int64_t>>& groups);
  void finish_locked(PassRecording& pass);

  Runtime& runtime_;
  std::mutex mutex_;
  std::map<int64_t, Root> roots_;
  /// Modules whose forward runs now, innermost last: (root, module serial).
  std::vector<std::pair<int64_t, int64_t>> open_;
  int64_t next_module_ = 0;
};

}  // namespace sharc
