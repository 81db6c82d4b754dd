#pragma once
// The order of one kind of pass: what was gathered after what. The one
// memory behind eager prefetch and cross-graph prefetch.
//
// [Note: gather order]
// After the first step the order of a pass's gathers is known: the next
// pass of the same kind asks for them again in the same order, as long as
// the code takes the same path. A GatherOrder records a pass as a sequence
// of steps, each a bucket of parameters gathered together (in one dtype),
// and in the next pass of its kind gathers the next step ahead so that the
// code finds it in flight. Two events drive it, and they are the only
// difference between the eager path and compiled graphs:
//
// - gather(step, bucket): the code asks for a gather now. Recorded in
//   `step` (the caller's name for it in this pass: a module's scope for
//   eager code, which adds one parameter at a time; a compiled graph's
//   bucket, a step of its own). It takes what was gathered ahead of it,
//   and it is found in the last pass's order, by its parameters, nearest
//   to where the pass is: the rest of the step it falls in is started.
// - reached(ids, fits): a point every rank reaches alike right after the
//   gather of `ids`. The step recorded after that one is started, if
//   `fits` lets it (a compiled graph's memory budget). Eager code reaches
//   such a point at every gather it asks for (so it gathers its module
//   and the next); a compiled graph at the point its schedule marks after
//   its last gather, its key (so it gathers the next graph's first bucket,
//   one bucket ahead). A compiled graph's point may start more than the next
//   step (Reach::kWhileFits): each step after it in turn, for as long as
//   `fits` lets each; a step so started counts as started by the point
//   right before it, for the rules below.
//
// A step is started at most once a pass. What was started ahead and not
// taken is given up (its parameters freed unless someone holds them):
// - at a point reached after a later step, if nothing of it was taken (the
//   pass went past it on another path: a graph other than the one that
//   followed last time ended), or at a point after a gather the order has
//   not seen;
// - at once, before a gather of some of its parameters in another dtype
//   (it would serve them otherwise);
// - at the end of the pass, all that is left: nothing gathered ahead stays
//   gathered past it. The pass's own order then becomes the one the next
//   pass follows, unless it gathered nothing (a backward without sharded
//   inputs keeps the old one).
// The compiled graphs' runtime also gives up what is ahead when the other
// kind of graph begins (give_up_ahead) or a shard under it changed (an
// optimizer step between two passes): it would serve old values.
//
// Every rank must issue the same collectives in the same order, so every
// decision here follows from gathers and points all ranks reach alike:
// the trigger is never a module being entered, and parameters that only
// some ranks gather (the members of a gather unit, gathered whole by their
// unit) are excluded. A compiled graph is found by its key, the parameters
// of its last gather, never by a compile counter: a graph recompiled on one
// rank only has the same key there as the graph it replaces elsewhere.
//
// This class holds the bookkeeping only; the runtime issues and frees what
// it asks for: [Note: eager prefetch] in runtime/eager_prefetch.h, [Note:
// cross-graph prefetch] in src/runtime/runtime_graph_prefetch.cpp. Not
// thread-safe: its owners call it under their lock.
//
// [Note: eager code and compiled graphs keep orders of their own]
// One class, one rule set, but separate instances: one per sharded root and
// kind of eager pass, one per kind of compiled graph. A pass that mixes the
// two (eager modules between compiled graphs) is two sequences, not one, so
// an eager step never starts a graph's bucket nor a graph's point an eager
// step, for two reasons:
// - their passes end at different points: an eager forward pass ends when
//   its root's outermost module exits (the only point every rank reaches
//   alike after its last read; where the root's forward is compiled, each
//   module whose hooks run eagerly ends one), a compiled forward pass when
//   a graph reads nothing the previous forward graph returned. A step in
//   both would be given up at one pass's end while the other still counts
//   on it, or stay gathered past the end of the pass that started it;
// - a graph's first bucket is held to the memory budget its schedule
//   carries at its marked point; an eager read carries no budget, so an
//   eager step could not start it within one.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace sharc {

/// One gather: its parameters and the dtype they are gathered in
/// (c10::ScalarType as an integer; kOwnDtype: each one's gather dtype).
struct GatherBucket {
  static constexpr int64_t kOwnDtype = -1;
  std::vector<int64_t> ids;
  int64_t dtype = kOwnDtype;

  bool operator==(const GatherBucket& other) const {
    return ids == other.ids && dtype == other.dtype;
  }
};

class GatherOrder {
 public:
  /// What an event asks of the runtime: buckets to start gathering now,
  /// then parameters to give up (free, unless held); give up first.
  struct Decision {
    std::vector<GatherBucket> start;
    std::vector<int64_t> give_up;
  };
  /// Whether a bucket may start ahead now (a memory budget); the default
  /// lets every bucket start.
  using Fits = std::function<bool(const GatherBucket&)>;

  /// Parameters never recorded nor started ahead (gather units' members).
  void exclude(int64_t id) { excluded_.insert(id); }

  /// The code asks for `bucket` now, in the step it names `step` (a new
  /// name opens a step). See [Note: gather order].
  /// `fits` says whether the rest of its recorded step may start with it.
  Decision gather(int64_t step, const GatherBucket& bucket, const Fits& fits = {});

  /// How far a point starts ahead.
  enum class Reach {
    kNextStep,   ///< the step recorded after the point's, once a pass
    kWhileFits,  ///< and the steps after it, one by one, while `fits` lets
                 ///< each (compiled graphs: see [Note: graph prefetch window])
  };
  /// A point every rank reaches alike, right after the gather of `ids`.
  Decision reached(const std::vector<int64_t>& ids, const Fits& fits = {},
                   Reach reach = Reach::kNextStep);

  /// The pass is over: returns what was started ahead and never taken, to
  /// give up. Its order becomes the one the next pass follows.
  std::vector<int64_t> end_pass();

  /// Gives up everything started ahead and not taken (the other kind of
  /// pass began, or a shard under it changed): returns its parameters.
  std::vector<int64_t> give_up_ahead();
  /// The parameters started ahead and not taken yet.
  std::vector<int64_t> ahead() const;

  /// The step of the last finished pass that first gathered `id`, or -1.
  int64_t step_of(int64_t id) const;

 private:
  struct Recording {
    std::vector<GatherBucket> steps;                 ///< in the order they began
    std::map<int64_t, std::vector<int64_t>> where;   ///< parameter -> the steps holding it
    std::map<int64_t, int64_t> named;                ///< the caller's step name -> its step
    /// Adds `bucket` to step `name`; returns whether any of it was new there.
    bool add(int64_t name, const GatherBucket& bucket);
  };
  struct Ahead {
    GatherBucket left;           ///< started ahead, not taken yet
    int64_t after = -1;          ///< the step whose point started it; -1: a gather did
    bool taken_any = false;
  };

  std::optional<int64_t> find(const std::vector<int64_t>& ids) const;
  std::optional<int64_t> gathered_in(const std::vector<int64_t>& ids) const;
  std::vector<int64_t> take(const GatherBucket& bucket);
  /// False when step `step` is past the recording or did not fit.
  bool start(int64_t step, int64_t after, const GatherBucket& asked, const Fits& fits,
             Decision& decision);
  void give_up_passed(std::optional<int64_t> point, Decision& decision);
  void forget_empty();

  std::set<int64_t> excluded_;
  Recording last_;                          ///< the last finished pass
  Recording now_;                           ///< this pass, so far
  std::set<int64_t> started_;               ///< steps of last_ started in this pass
  std::set<std::pair<int64_t, int64_t>> found_;  ///< (step of last_, parameter) gathered again
  int64_t at_ = -1;                         ///< the furthest step of last_ this pass reached
  std::vector<Ahead> ahead_;
};

}  // namespace sharc
