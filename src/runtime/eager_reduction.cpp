// Eager gradients reduced asynchronously: see [Note: eager reduction].

#include "sharc/runtime/eager_reduction.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "sharc/core/error.h"
#include "sharc/runtime/runtime.h"

namespace sharc {

/// Parameters whose gathers one stretch of forward made, by slot in gather
/// order, and what the backward pass running now has done with them.
struct EagerBucket {
  std::vector<int64_t> ids;
  int64_t bytes = 0;      ///< of the full gradients
  uint64_t wait_at = 0;   ///< the wait nodes' sequence number (see the note)
  // One backward pass:
  std::vector<bool> deferred;  ///< by slot: a gather unit's, held back (no collective)
  int64_t to_reduce = 0;       ///< slots not deferred
  std::vector<bool> delivered;
  int64_t delivered_count = 0;
  int64_t collected_count = 0;  ///< of the to_reduce slots
  int64_t taken = 0;
  std::vector<std::weak_ptr<EagerRun>> run_of;  ///< the reduction carrying each slot
  std::vector<at::Tensor> results;               ///< reduced, not taken yet

  bool holds(int64_t id) const { return std::find(ids.begin(), ids.end(), id) != ids.end(); }
  void add_slot(int64_t id, int64_t grad_bytes, bool held) {
    ids.push_back(id);
    bytes += grad_bytes;
    deferred.push_back(held);
    if (!held) ++to_reduce;
    delivered.push_back(false);
    run_of.emplace_back();
    results.emplace_back();
  }
  void reset_pass() {
    std::fill(delivered.begin(), delivered.end(), false);
    delivered_count = 0;
    collected_count = 0;
    taken = 0;
    std::fill(run_of.begin(), run_of.end(), std::weak_ptr<EagerRun>());
    std::fill(results.begin(), results.end(), at::Tensor());
  }
};

/// Gradients of one bucket reduced by one collective.
struct EagerRun {
  std::shared_ptr<EagerBucket> bucket;
  std::vector<size_t> slots;
  std::vector<at::Tensor> grads;  ///< until started
  int64_t token = -1;             ///< once started
};

namespace {

using torch::autograd::variable_list;

// Autograd nodes are owned by std::shared_ptr up to torch 2.11 and by
// c10::intrusive_ptr later; Edge::function names which.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);
constexpr bool kIntrusiveNodes = !std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (kIntrusiveNodes && sizeof(T) > 0) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

/// The gather's backward: hands the full gradient to its bucket and passes a
/// token on to the wait.
class ReduceStart : public torch::autograd::Node {
 public:
  ReduceStart(c10::intrusive_ptr<Runtime> owner, std::shared_ptr<EagerBucket> bucket,
              size_t slot, const at::Tensor& full, at::TensorOptions token)
      : owner_(std::move(owner)), bucket_(std::move(bucket)), slot_(slot),
        sizes_(full.sizes().vec()), options_(full.options()), token_(token) {}

  std::string name() const override { return "sharc::GatherBackward"; }

  variable_list apply(variable_list&& grads) override {
    at::Tensor grad = std::move(grads[0]);
    // Every rank reduces every gathered parameter, used or not.
    if (!grad.defined()) grad = at::zeros(sizes_, options_);
    // A sparse gradient (nn.Embedding(sparse=True)) is reduced dense: the
    // shard and its optimizer state are dense.
    if (grad.is_sparse()) grad = grad.to_dense();
    owner_->eager_reduction().deliver(bucket_, slot_, std::move(grad));
    return {at::empty({}, token_)};
  }

 private:
  c10::intrusive_ptr<Runtime> owner_;
  std::shared_ptr<EagerBucket> bucket_;
  size_t slot_;
  std::vector<int64_t> sizes_;
  at::TensorOptions options_;
  at::TensorOptions token_;  ///< what the wait expects: a value of no meaning
};

/// Between the gather's backward and the shard: the reduced shard gradient.
class ReduceWait : public torch::autograd::Node {
 public:
  ReduceWait(uint64_t sequence_nr, c10::intrusive_ptr<Runtime> owner,
             std::shared_ptr<EagerBucket> bucket, size_t slot)
      : Node(sequence_nr), owner_(std::move(owner)), bucket_(std::move(bucket)), slot_(slot) {}

  std::string name() const override { return "sharc::ReduceScatterWait"; }

  variable_list apply(variable_list&& /*token*/) override {
    return {owner_->eager_reduction().take(bucket_, slot_)};
  }

 private:
  c10::intrusive_ptr<Runtime> owner_;
  std::shared_ptr<EagerBucket> bucket_;
  size_t slot_;
};

}  // namespace

void EagerReduction::enter_module(int64_t root) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_roots_.push_back(root);
}

void EagerReduction::exit_module() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!open_roots_.empty()) open_roots_.pop_back();
  if (close_at_exit_) {
    open_.reset();
    close_at_exit_ = false;
  }
  if (open_roots_.empty()) {  // the forward is over: the next one draws afresh
    open_.reset();
    last_opened_at_ = 0;
  }
}

int64_t EagerReduction::in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(in_flight_.size());
}

void EagerReduction::set_bucket_bytes(int64_t root, int64_t bytes) {
  SHARC_CHECK(bytes >= 0, "sharc: the eager reduction bucket size must be at least 0 bytes, "
              "got ", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  bucket_bytes_[root] = bytes;
}

int64_t EagerReduction::bucket_bytes(int64_t root) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = bucket_bytes_.find(root);
  return it == bucket_bytes_.end() ? kDefaultBucketBytes : it->second;
}

std::shared_ptr<EagerBucket> EagerReduction::open_bucket_locked(int64_t id) {
  // A parameter read twice in one stretch (a tied weight in two modules)
  // gathers twice: each gather's gradient goes to a bucket of its own.
  if (open_ && !open_->holds(id)) return open_;
  auto bucket = std::make_shared<EagerBucket>();
  bucket->wait_at = open_ ? open_->wait_at : last_opened_at_;
  if (!open_) {
    // The waits of the next bucket run just before the first node made
    // from here on. Number 0 is kept for the first bucket's waits (the end
    // of backward): no node of a forward gets it.
    if (at::sequence_number::peek() == 0) at::sequence_number::get_and_increment();
    last_opened_at_ = at::sequence_number::peek() - 1;
  }
  open_ = bucket;
  close_at_exit_ = false;
  return bucket;
}

std::shared_ptr<EagerBucket> EagerReduction::unit_bucket_locked() const {
  // A gather unit member's gather: its gradient is held back for the unit's
  // reduction, and how often the unit's modules read it depends on the
  // rank's data (a loop, routing). In the open bucket, a second read would
  // close it early, and its bytes would close it at another module exit,
  // so the ranks' buckets would part; on its own it changes nothing of them.
  auto bucket = std::make_shared<EagerBucket>();
  bucket->wait_at = open_ ? open_->wait_at : last_opened_at_;
  return bucket;
}

void EagerReduction::connect(at::Tensor& full, const at::Tensor& shard, int64_t id,
                             c10::ScalarType reduce, c10::intrusive_ptr<Runtime> owner) {
  std::shared_ptr<EagerBucket> bucket;
  size_t slot = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool deferred = runtime_.reduction_deferred(id);
    bucket = deferred ? unit_bucket_locked() : open_bucket_locked(id);
    slot = bucket->ids.size();
    const int64_t reduce_bytes = full.numel() * static_cast<int64_t>(c10::elementSize(reduce));
    bucket->add_slot(id, reduce_bytes, deferred);
    const auto limit = open_roots_.empty() ? bucket_bytes_.end()
                                           : bucket_bytes_.find(open_roots_.back());
    if (!deferred &&
        bucket->bytes >= (limit == bucket_bytes_.end() ? kDefaultBucketBytes : limit->second)) {
      close_at_exit_ = true;
    }
  }
  auto wait = make_node<ReduceWait>(bucket->wait_at, owner, bucket, slot);
  wait->set_next_edges(torch::autograd::collect_next_edges(shard));
  // The token the wait receives: a scalar the engine accepts as a gradient
  // (a floating dtype, the shard's device) and nobody reads.
  const at::TensorOptions token = shard.options();
  wait->add_input_metadata(at::empty({}, token));
  auto start = make_node<ReduceStart>(std::move(owner), bucket, slot, full, token);
  start->set_next_edges({torch::autograd::Edge(NodePtr(wait), 0)});
  torch::autograd::set_history(full, NodePtr(start));
}

void EagerReduction::deliver(const std::shared_ptr<EagerBucket>& bucket, size_t slot,
                             at::Tensor grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A second backward over the same forward (retain_graph=True) begins
  // where the first left this bucket, or left a gradient unreduced.
  if (bucket->delivered[slot]) finish_pass_locked(bucket);
  if (bucket->deferred[slot]) {
    // A gather unit's parameter: held back for the unit's own reduction at
    // the end of backward (no collective now, a zero shard gradient). It
    // joins no bucket, since ranks run different members of a unit.
    bucket->delivered[slot] = true;
    ++bucket->delivered_count;
    bucket->results[slot] = runtime_.wait_reduce_scatter(
        runtime_.start_reduce_scatter({bucket->ids[slot]}, {std::move(grad)}))[0];
    return;
  }
  if (collected_ && collected_->bucket != bucket) start_collected_locked();
  if (!collected_) {
    collected_ = std::make_shared<EagerRun>();
    collected_->bucket = bucket;
  }
  collected_->slots.push_back(slot);
  collected_->grads.push_back(std::move(grad));
  bucket->delivered[slot] = true;
  bucket->run_of[slot] = collected_;
  ++bucket->delivered_count;
  if (++bucket->collected_count == bucket->to_reduce) start_collected_locked();
}

void EagerReduction::start_collected_locked() {
  std::shared_ptr<EagerRun> run = std::move(collected_);
  collected_.reset();
  while (in_flight_.size() >= kInFlight) complete_locked(in_flight_.front());
  std::vector<int64_t> ids;
  for (size_t slot : run->slots) ids.push_back(run->bucket->ids[slot]);
  run->token = runtime_.start_reduce_scatter(ids, run->grads);
  run->grads.clear();  // copied into the collective's input
  ++reductions_started_;
  in_flight_.push_back(std::move(run));
}

void EagerReduction::complete_locked(const std::shared_ptr<EagerRun>& run) {
  auto it = std::find(in_flight_.begin(), in_flight_.end(), run);
  if (it == in_flight_.end()) return;  // completed already
  std::shared_ptr<EagerRun> keep = *it;
  in_flight_.erase(it);
  std::vector<at::Tensor> shards = runtime_.wait_reduce_scatter(keep->token);
  for (size_t i = 0; i < keep->slots.size(); ++i) {
    keep->bucket->results[keep->slots[i]] = std::move(shards[i]);
  }
}

at::Tensor EagerReduction::take(const std::shared_ptr<EagerBucket>& bucket, size_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  SHARC_CHECK(bucket->delivered[slot], "sharc: the eager reduction of '",
              runtime_.name(bucket->ids[slot]), "' was waited on before its gradient came");
  if (!bucket->results[slot].defined()) {
    if (collected_ && collected_->bucket == bucket) start_collected_locked();
    std::shared_ptr<EagerRun> run = bucket->run_of[slot].lock();
    SHARC_CHECK(run, "sharc: the eager reduction of '", runtime_.name(bucket->ids[slot]),
                "' was lost (taken twice in one backward pass?)");
    complete_locked(run);
  }
  at::Tensor shard_grad = std::move(bucket->results[slot]);
  bucket->results[slot] = at::Tensor();
  // Every gradient of this pass taken: the next pass (retain_graph) starts
  // afresh.
  if (++bucket->taken == bucket->delivered_count) bucket->reset_pass();
  return shard_grad;
}

void EagerReduction::finish_pass_locked(const std::shared_ptr<EagerBucket>& bucket) {
  // What the last pass started and nobody took is waited on, so every rank
  // still completes every collective it started, and dropped.
  if (collected_ && collected_->bucket == bucket) start_collected_locked();
  for (const auto& weak : bucket->run_of) {
    if (std::shared_ptr<EagerRun> run = weak.lock()) complete_locked(run);
  }
  bucket->reset_pass();
}

}  // namespace sharc
