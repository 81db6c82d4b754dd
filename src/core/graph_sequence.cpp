#include "sharc/core/graph_sequence.h"

namespace sharc {
namespace {

bool shares_params(const GatherBucket& a, const GatherBucket& b) {
  for (int64_t id : a.ids) {
    for (int64_t other : b.ids) {
      if (id == other) return true;
    }
  }
  return false;
}

}  // namespace

std::optional<GatherBucket> GraphSequence::end_graph(const Graph& graph) {
  if (last_end_ == graph) return std::nullopt;  // its second prefetch point
  last_end_ = graph;
  std::optional<GatherBucket> stale;
  if (ahead_ && ahead_->after != graph) {  // the graph it was for has come and gone
    stale = ahead_->bucket;
    ahead_.reset();
  }
  return stale;
}

std::optional<GatherBucket> GraphSequence::follower_to_start() const {
  if (!last_end_ || (ahead_ && ahead_->after == *last_end_)) return std::nullopt;
  auto it = follower_.find(*last_end_);
  if (it == follower_.end()) return std::nullopt;
  return it->second;
}

void GraphSequence::started_ahead(const GatherBucket& bucket) {
  ahead_ = Ahead{*last_end_, bucket};
}

std::optional<GatherBucket> GraphSequence::graph_gathers(int64_t kind,
                                                         const GatherBucket& bucket) {
  if (last_end_ && last_end_->first == kind) follower_[*last_end_] = bucket;
  last_end_.reset();
  if (!ahead_) return std::nullopt;
  if (ahead_->bucket == bucket) {
    ahead_.reset();  // taken
    return std::nullopt;
  }
  // A later gather of the same kind may take it, unless this one gathers
  // some of its parameters otherwise (in another bucket or dtype).
  if (ahead_->after.first == kind && !shares_params(ahead_->bucket, bucket)) return std::nullopt;
  std::optional<GatherBucket> stale = ahead_->bucket;
  ahead_.reset();
  return stale;
}

}  // namespace sharc

namespace sharc {

std::optional<GatherBucket> GraphSequence::end_pass(int64_t kind) {
  if (last_end_ && last_end_->first == kind) last_end_.reset();
  if (!ahead_ || ahead_->after.first != kind) return std::nullopt;
  std::optional<GatherBucket> stale = ahead_->bucket;
  ahead_.reset();
  return stale;
}

std::optional<GatherBucket> GraphSequence::ahead() const {
  if (!ahead_) return std::nullopt;
  return ahead_->bucket;
}

}  // namespace sharc
