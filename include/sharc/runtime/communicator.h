#pragma once
// The collectives sharc needs, over a c10d::ProcessGroup of any backend.
//
// The process group dispatches by tensor device (CPU tensors to gloo, CUDA
// tensors to NCCL), so nothing here names a backend. Every call is
// non-blocking: it returns the c10d::Work to wait on before the output is
// read (on CUDA, Work::wait() orders the current stream after the
// communication stream; on CPU it blocks the calling thread).

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace sharc {

/// Drops a Work that was waited on, after giving the communication thread
/// that ran it a moment to drop its own reference first. Whoever drops the
/// last reference frees the collective's input (a cast shard, a gradient
/// bucket), and gloo's thread lets go of a work just after completing it:
/// left to chance, the buffer is freed whenever that thread runs next (and
/// out of sight of per-thread allocator tracing). Only for CPU works, and
/// bounded (a millisecond): a backend that keeps its works longer is not
/// waited for.
void release_waited(c10::intrusive_ptr<c10d::Work>& work);

/// Blocks until `work` is done, then drops it as release_waited() does: for
/// a collective waited where it is issued, whose input is a temporary.
void wait_and_release(c10::intrusive_ptr<c10d::Work> work);

class Communicator {
 public:
  /// Resolves the group by the name c10d registered it under
  /// (`ProcessGroup.group_name` in Python); throws if none is registered.
  /// Holds it weakly: destroying the group (destroy_process_group) really
  /// ends it, and later collectives here fail with a clear error.
  explicit Communicator(const std::string& group_name);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const std::string& group_name() const { return group_name_; }
  /// Whether this communicator still talks through the group c10d now
  /// registers under its name (a destroyed and re-created group may reuse it).
  bool is_current() const;

  /// Whether the group still exists (it is held weakly: sharc never keeps a
  /// process group alive past destroy_process_group()).
  bool is_alive() const;

  /// Non-blocking. `out` holds world_size * shard.numel() elements and is
  /// written in rank order.
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor& out, at::Tensor& shard);

  /// Non-blocking. Sums `in` (world_size * out.numel() elements) over the
  /// group and leaves this rank's slice in `out`; `in` may be overwritten.
  /// SUM, never AVG: some gloo releases silently treat AVG as SUM, so the
  /// caller divides. CPU tensors go through an all-to-all and a sum that
  /// the returned Work's wait() performs on the waiting thread (see [Note:
  /// reduce-scatter on CPU] in communicator.cpp), as do device tensors on
  /// gloo; device tensors on another backend (NCCL) through its
  /// reduce-scatter.
  ///
  /// `summed_from` > 0 lets the all-to-all's wait sum only the columns of
  /// `out` from there on: the earlier ones stay as the W rows that arrived,
  /// for the caller to take with take_unsummed_rows() and sum where the values
  /// go (one pass instead of a sum into `out` and a copy out of it). The
  /// columns before `summed_from` in `out` are then left unwritten (unless
  /// sum_unsummed_rows() is called). A
  /// backend's own reduce-scatter sums every column whatever it says.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_sum(at::Tensor& out, at::Tensor& in,
                                                    int64_t summed_from = 0);

  /// After `work` (from reduce_scatter_sum) was waited on: the [W,
  /// summed_from] rows its wait left unsummed, handed over once (later
  /// calls, and works that summed everything, give an undefined tensor).
  static at::Tensor take_unsummed_rows(c10d::Work& work);
  /// After `work` was waited on: sums the rows it left unsummed into `out`
  /// after all and lets them go, so that a reduction waited before its
  /// shard gradients are wanted holds `out` only (take_unsummed_rows() then
  /// gives nothing).
  static void sum_unsummed_rows(c10d::Work& work);

  /// The name of the backend ("gloo", "nccl") that serves `t`'s device.
  std::string backend_name(const at::Tensor& t) const;

  /// Non-blocking. Element-wise maximum of `t` over the group, in place.
  c10::intrusive_ptr<c10d::Work> all_reduce_max(at::Tensor& t);
  /// Non-blocking. Element-wise sum of `t` over the group, in place (the
  /// replicate group's gradient all-reduce; SUM for the reason above).
  c10::intrusive_ptr<c10d::Work> all_reduce_sum(at::Tensor& t);

 private:
  /// The group for one call; throws naming the group if it was destroyed.
  c10::intrusive_ptr<c10d::ProcessGroup> live_group() const;

  std::string group_name_;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
};

}  // namespace sharc
