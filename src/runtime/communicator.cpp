#include "sharc/runtime/communicator.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/version.h>

#include "sharc/core/error.h"

namespace sharc {

Communicator::Communicator(const std::string& group_name)
    : group_name_(group_name), group_(c10::intrusive_ptr<c10d::ProcessGroup>()) {
  auto group = c10d::resolve_process_group(group_name);
  SHARC_CHECK(group, "sharc: no process group is registered under the name '",
              group_name, "'");
  rank_ = group->getRank();
  world_size_ = group->getSize();
  group_ = c10::weak_intrusive_ptr<c10d::ProcessGroup>(group);
}

bool Communicator::is_alive() const { return !group_.expired(); }

bool Communicator::is_current() const {
  auto group = group_.lock();
  if (!group) return false;
  try {
    return c10d::resolve_process_group(group_name_).get() == group.get();
  } catch (const c10::Error&) {
    return false;  // the name is no longer registered
  }
}

// Destroyed means unregistered (destroy_process_group), even where something
// outside sharc still holds the group object.
c10::intrusive_ptr<c10d::ProcessGroup> Communicator::live_group() const {
  auto group = group_.lock();
  SHARC_CHECK(group && is_current(), "sharc: the process group '", group_name_, "' has been destroyed "
              "(destroy_process_group); a module sharded on it can no longer gather or "
              "reduce: create a new group and shard a freshly built module on it");
  return group;
}

// torch 2.13 renamed the single-tensor collectives (the old names remain as
// deprecated aliases); torch 2.11 only has the old names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define SHARC_ALL_GATHER_SINGLE all_gather_single
#define SHARC_REDUCE_SCATTER_SINGLE reduce_scatter_single
#else
#define SHARC_ALL_GATHER_SINGLE _allgather_base
#define SHARC_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#endif

c10::intrusive_ptr<c10d::Work> Communicator::all_gather(at::Tensor& out,
                                                        at::Tensor& shard) {
  return live_group()->SHARC_ALL_GATHER_SINGLE(out, shard, c10d::AllgatherOptions());
}

c10::intrusive_ptr<c10d::Work> Communicator::reduce_scatter_sum(at::Tensor& out,
                                                                at::Tensor& in) {
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return live_group()->SHARC_REDUCE_SCATTER_SINGLE(out, in, options);
}

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_max(at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  return live_group()->allreduce(tensors, options);
}

}  // namespace sharc
