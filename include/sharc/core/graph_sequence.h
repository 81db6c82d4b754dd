#pragma once
// Which compiled graph follows which: the memory behind cross-graph prefetch.
//
// [Note: cross-graph prefetch]
// When graph breaks split a model, each compiled graph gathers its own
// parameters, and the first gather of the next graph cannot start before
// that graph does: the eager code between the two (and the tail of the
// first graph) runs with nothing in flight. The runtime therefore records,
// in each pass, which graph's first gather followed which graph's end, and
// in later passes starts that gather at the end of the earlier graph (a
// point in it the schedule marks, within its memory budget).
//
// Followers are recorded within a pass only: the runtime ends a backward
// pass at the autograd engine's end-of-backward callback, and a forward pass
// where a compiled forward reads nothing the previous forward graph returned
// (end_pass), so nothing gathered ahead waits for the next call.
//
// A graph is known by its kind (forward or backward) and a key the bridge
// derives from its schedule (the parameters of its last gather), never by
// a compile counter: a graph recompiled on one rank only gets the same key
// there as the graph it replaces on the others, so every rank prefetches
// alike. Only a graph of the same kind is followed: the forward's last
// graph is followed by the loss and backward, the backward's last by an
// optimizer step, and a gather started across either would be wasted or
// serve values the step has changed since.
//
// A prefetch the next graph does not take (another path through the code
// this time) is given up (its parameters freed if nobody holds them) when
// the next graph ends, a graph of the other kind begins or the backward pass
// ends: points every rank reaches alike. The runtime also gives one up whose
// shards changed since it started (an optimizer step between two passes),
// rather than serve old values. This class holds the bookkeeping only; the
// runtime issues the collectives it asks for.

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace sharc {

/// One gather a graph starts with: its parameters and the dtype code they
/// are gathered in (c10::ScalarType as an integer).
struct GatherBucket {
  std::vector<int64_t> ids;
  int64_t dtype = -1;

  bool operator==(const GatherBucket& other) const {
    return ids == other.ids && dtype == other.dtype;
  }
};

/// What one pass of compiled graphs did, and what it prefetched. Not
/// thread-safe: the runtime calls it under its lock.
class GraphSequence {
 public:
  /// A graph: its kind (the bridge's code for forward or backward) and its
  /// key (the parameters of its last gather).
  using Graph = std::pair<int64_t, std::vector<int64_t>>;

  /// `graph` reached its prefetch point (it may have more than one; the
  /// first counts). Returns a bucket prefetched after another graph's end
  /// that was not taken: to give up now.
  std::optional<GatherBucket> end_graph(const Graph& graph);

  /// The bucket to start ahead now: the first gather of the graph that
  /// followed the graph that ended last, when that was recorded and nothing
  /// was started ahead for this end yet.
  std::optional<GatherBucket> follower_to_start() const;

  /// The runtime started follower_to_start()'s bucket.
  void started_ahead(const GatherBucket& bucket);

  /// A compiled graph of `kind` starts gathering `bucket`. The first gather
  /// after a graph of the same kind ended is recorded as its follower. A
  /// bucket started ahead is taken if this is it; it is returned to give up
  /// (before this gather starts) if a graph of the other kind begins, or
  /// this gather serves some of its parameters otherwise.
  std::optional<GatherBucket> graph_gathers(int64_t kind, const GatherBucket& bucket);

  /// The pass of `kind` is over (the backward's end, or a forward graph
  /// that starts a new forward pass): nothing that ended in it is followed
  /// by what comes next. Returns a bucket it started ahead and nobody took,
  /// to give up.
  std::optional<GatherBucket> end_pass(int64_t kind);

  /// The bucket started ahead and not taken yet, if any.
  std::optional<GatherBucket> ahead() const;
  /// Forgets the bucket started ahead (the runtime gave it up).
  void give_up_ahead() { ahead_.reset(); }

 private:
  struct Ahead {
    Graph after;  ///< the graph whose end started it
    GatherBucket bucket;
  };

  std::map<Graph, GatherBucket> follower_;  ///< graph -> the first gather after its end
  std::optional<Graph> last_end_;           ///< ended, and no gather since
  std::optional<Ahead> ahead_;              ///< started ahead, not taken yet
};

}  // namespace sharc
