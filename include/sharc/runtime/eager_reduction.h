#pragma once
// Eager gradients reduced asynchronously, a bucket of modules at a time.
//
// [Note: eager reduction]
// An eager gather's gradient is the reduce-scatter of the full gradient into
// the shard. Done inside the gather's backward, one blocking collective per
// parameter, backward stops at every parameter while the ranks exchange.
// Here the backward of a gather only hands the full gradient to its bucket;
// the shard's gradient comes out of a second autograd node, a *wait*, that
// sits between the gather's backward and the shard (so `autograd.grad`,
// hooks on the shard and on AccumulateGrad, retain_graph and create_graph
// all see the reduced gradient, as before):
//
//   shard --AccumulateGrad-- wait <-- token -- gather backward <-- grad(full)
//
// Buckets are drawn in forward. The gathers of one module's forward go to
// the open bucket; at a module's exit, a bucket holding at least
// `bucket_bytes` of full gradients closes, and the next gather opens a new
// one. So a bucket is one module, or a run of small neighbouring modules.
//
// In backward, gradients of one bucket are collected as they come. The
// bucket starts one reduce-scatter as soon as all its gradients are in; a
// gradient of another bucket arriving first starts what was collected (the
// rest follows as a bucket of its own), so gradients never wait on each
// other across buckets. At most kInFlight reductions are in flight: starting
// one more first waits the oldest.
//
// The waits run late by their autograd priority. The engine runs, of the
// nodes ready, the one with the highest sequence number first (the latest
// made in forward). A bucket's wait nodes carry the sequence number at
// which the previous bucket opened in forward, lower than every node of
// that bucket's modules and higher than every node before it: the engine
// waits for bucket k once the backward of bucket k-1's modules has run, so
// its reduction overlaps them. The first bucket's waits carry 0: the end of
// backward.
//
// A gather unit's members (whose gradients wait for the unit's own
// reduction) join no bucket: the unit's modules may run a different number
// of times on each rank.
//
// Every rank draws the same buckets from the same forward and the engine
// runs one backward in the same order on every rank, so the ranks start the
// same reductions in the same order. Ranks whose code differs are caught
// by the collective agreement, as everywhere.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

namespace sharc {

class Runtime;
struct EagerBucket;
struct EagerRun;

class EagerReduction {
 public:
  /// At most this many reductions in flight; starting one more waits the
  /// oldest first.
  static constexpr size_t kInFlight = 2;
  /// Full-gradient bytes at which a bucket closes (at a module's exit).
  static constexpr int64_t kDefaultBucketBytes = 4 << 20;

  explicit EagerReduction(Runtime& runtime) : runtime_(runtime) {}

  /// A module of sharded root `root` begins its forward, and ends it (the
  /// eager schedule's scope).
  void enter_module(int64_t root);
  void exit_module();
  /// Where root `root`'s buckets close (ShardConfig.eager_reduce_bucket_bytes).
  void set_bucket_bytes(int64_t root, int64_t bytes);
  int64_t bucket_bytes(int64_t root);

  /// Wires `full`, just gathered from `shard` (parameter `id`, no autograd
  /// history yet), into autograd: its gradient is reduced through the open
  /// bucket and reaches `shard` through a wait node. `reduce`: the
  /// parameter's reduce dtype (what its gradient weighs in a bucket).
  /// `owner` keeps the runtime alive as long as the graph.
  void connect(at::Tensor& full, const at::Tensor& shard, int64_t id, c10::ScalarType reduce,
               c10::intrusive_ptr<Runtime> owner);

  /// Backward of the gather of `slot`: its full gradient.
  void deliver(const std::shared_ptr<EagerBucket>& bucket, size_t slot, at::Tensor grad);
  /// The wait of `slot`: its reduced shard gradient.
  at::Tensor take(const std::shared_ptr<EagerBucket>& bucket, size_t slot);

  /// Reductions started so far, and the gradients they carried (tests and
  /// statistics).
  int64_t reductions_started() const { return reductions_started_; }
  /// Reductions started and not waited on yet.
  int64_t in_flight();

 private:
  std::shared_ptr<EagerBucket> open_bucket_locked(int64_t id);
  /// A bucket of its own for a gather unit member's gather (held back),
  /// leaving the ranks' buckets as their other parameters draw them.
  std::shared_ptr<EagerBucket> unit_bucket_locked() const;
  void start_collected_locked();
  void complete_locked(const std::shared_ptr<EagerRun>& run);
  void finish_pass_locked(const std::shared_ptr<EagerBucket>& bucket);

  Runtime& runtime_;
  std::mutex mutex_;
  std::map<int64_t, int64_t> bucket_bytes_;  ///< by root; kDefaultBucketBytes if unset
  std::vector<int64_t> open_roots_;      ///< the root of each module open in forward
  std::shared_ptr<EagerBucket> open_;    ///< where this forward's gathers go
  bool close_at_exit_ = false;           ///< open_ is full: closes at the next exit
  uint64_t last_opened_at_ = 0;          ///< sequence number the last bucket opened at
  std::shared_ptr<EagerRun> collected_;  ///< gradients of one bucket, not started
  std::deque<std::shared_ptr<EagerRun>> in_flight_;
  int64_t reductions_started_ = 0;
};

}  // namespace sharc
