#pragma once
// How torch.ops.sharc operators find their Runtime.
//
// Operators take plain arguments (a process group's name and a parameter id),
// never Python objects, so that Dynamo, AOTAutograd and Inductor can treat
// them like any other op. The table maps a group name to the Runtime of that
// group in this process, just as c10d maps the name to the ProcessGroup; it
// holds no per-parameter state and is written only by Runtime creation.

#include <mutex>
#include <string>
#include <unordered_map>

#include "sharc/runtime/runtime.h"

namespace sharc {

class RuntimeTable {
 public:
  /// The process's table.
  static RuntimeTable& instance();

  /// The group's Runtime, created on first use (resolving the process group).
  c10::intrusive_ptr<Runtime> get_or_create(const std::string& group_name);
  /// The group's Runtime; throws if sharc.shard() never used this group.
  c10::intrusive_ptr<Runtime> get(const std::string& group_name);

 private:
  /// Drops the runtimes of groups that no longer exist (their modules may
  /// still hold them; the table does not).
  void forget_destroyed_locked();

  std::mutex mutex_;
  std::unordered_map<std::string, c10::intrusive_ptr<Runtime>> runtimes_;
};

}  // namespace sharc
