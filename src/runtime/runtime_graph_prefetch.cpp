// Cross-graph prefetch: the Runtime's side. The compiled graphs'
// start_gather and prefetch_next_graph ops call these; a GatherOrder per
// kind of graph (sharc/core/gather_order.h) keeps the order, this file
// issues and gives up the collectives it asks for. Also the one
// end-of-backward callback, for compiled graphs and the eager path alike.
//
// [Note: cross-graph prefetch]
// When graph breaks split a model, each compiled graph gathers its own
// parameters, and the first gather of the next graph cannot start before
// that graph does: the eager code between the two (and the tail of the
// first graph) runs with nothing in flight. Each compiled gather is
// therefore a step of its own in the order of its kind of graph (forward,
// backward), and each graph reaches a point after its last gather (the
// prefetch point its schedule marks: see mark_graph_prefetch.cpp) where the
// step recorded after that gather last time, the next graph's first
// bucket, starts within the graph's memory budget ([Note: gather order]).
//
// Orders are followed within a pass only: a backward pass ends at the
// autograd engine's end-of-backward callback, a forward pass where a
// compiled forward reads nothing that derives from what a forward graph
// of the pass returned ([Note: forward dataflow]), so nothing gathered
// ahead waits for the next call.
// Forward and backward keep separate orders: the forward's last graph is
// followed by the loss and backward, the backward's last by an optimizer
// step, and a gather started across either would be wasted or serve values
// the step has changed since. So a graph of the other kind beginning gives
// up what is ahead, and so does a changed shard under it.
//
// [Note: graph prefetch window]
// Graphs split by many graph breaks gather little each, and on a host whose
// collectives cost more to issue than to carry (latency, and ranks meeting
// at every collective), one collective per graph is the step. So a graph's
// point starts the next recorded graph's bucket and the graphs' after it,
// one collective per dtype for all, until the bytes started ahead and not
// yet taken would pass kGraphPrefetchWindowBytes or the graph's memory
// budget. The first bucket a point starts is held to the budget only, as
// before the window, whatever else is ahead: a point adds at most one
// bucket beyond the window and each graph takes one, so what is ahead stays
// within the window and one graph's bucket. Every later point tops the
// window up again. Each rank decides
// from the same recorded order, the same sizes and the same budget, so all
// start the same collectives; what was started for a graph that does not
// come is given up by the rules of [Note: gather order].
//
// [Note: the budget across graphs]
// A graph's schedule holds its own peak to the budget; what a point starts
// for later graphs is held beside their peaks, so the points count it so:
// - what the point's collectives allocate: each parameter once (a tied
//   weight two of the buckets read), and a collective of more than one
//   parameter its staging buffer too (as large again, until its wait);
// - at the point: the bytes gathered then and what it starts stay within
//   the budget;
// - a bucket beyond the next graph's first (or any, with some already
//   ahead): what is ahead then, and the largest peak a graph of this kind
//   was scheduled to (note_graph_peak, each graph at its compile), stay
//   within the budget too: every graph it passes runs with it gathered.
// Before this, a 3-graph model with a tied weight and a 3000-byte budget
// peaked at 5312 bytes from its second step on.

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "sharc/runtime/runtime.h"

namespace sharc {

GatherOrder& Runtime::graph_order(int64_t graph_kind) {
  return graph_kind == kBackwardGraph ? backward_graphs_ : forward_graphs_;
}

GatherOrder& Runtime::other_graph_order(int64_t graph_kind) {
  return graph_kind == kBackwardGraph ? forward_graphs_ : backward_graphs_;
}

int64_t Runtime::add_gather_unit(int64_t root, const std::vector<int64_t>& ids,
                                 const std::vector<at::Tensor>& shards, bool keep) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t id : ids) {
      forward_graphs_.exclude(id);
      backward_graphs_.exclude(id);
    }
  }
  return eager_scope_.add_unit(root, ids, shards, keep);
}

void Runtime::start_graph_gather(int64_t graph_kind, const std::vector<int64_t>& ids,
                                 c10::ScalarType dtype) {
  std::lock_guard<std::mutex> lock(mutex_);
  give_up_changed_ahead_locked();
  drop_unheld_locked(other_graph_order(graph_kind).give_up_ahead());
  // A graph's gather starts nothing beyond itself: its schedule's budget
  // counted that bucket only.
  const GatherOrder::Decision decision = graph_order(graph_kind).gather(
      graph_gathers_++, GatherBucket{ids, static_cast<int64_t>(dtype)},
      [](const GatherBucket&) { return false; });
  drop_unheld_locked(decision.give_up);
  if (graph_kind == kBackwardGraph) queue_end_of_backward_locked();
  start_gathers_locked(ids, dtype);
}

void Runtime::note_graph_peak(int64_t graph_kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t& most = graph_kind == kBackwardGraph ? backward_graph_peak_ : forward_graph_peak_;
  most = std::max(most, bytes);
}

void Runtime::prefetch_next_graph(int64_t graph_kind, const std::vector<int64_t>& key,
                                  int64_t budget_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  give_up_changed_ahead_locked();
  GatherOrder& order = graph_order(graph_kind);
  // See [Note: graph prefetch window] and [Note: the budget across graphs].
  const int64_t window = bytes_gathering_ahead_locked(order.ahead());
  const int64_t gathered = accounting_.stats().gathered_bytes;
  const int64_t later_peak = graph_kind == kBackwardGraph ? backward_graph_peak_
                                                          : forward_graph_peak_;
  StartingAhead starting;
  auto fits = [&](const GatherBucket& next) {
    StartingAhead with_next = starting;
    if (!add_ahead_locked(next, with_next)) return false;
    const int64_t cost = with_next.allocated();
    if (budget_bytes >= 0 && gathered + cost > budget_bytes) return false;
    // The first bucket a point starts is held to the budget only (the next
    // graph's, as before the window); those after it to the window too,
    // and to the budget with a later graph's own peak beside them.
    if (!starting.ids.empty() || window > 0) {
      if (window + with_next.bytes() > kGraphPrefetchWindowBytes) return false;
      if (budget_bytes >= 0 && window + cost + later_peak > budget_bytes) return false;
    }
    starting = std::move(with_next);
    return true;
  };
  const GatherOrder::Decision decision =
      order.reached(key, fits, GatherOrder::Reach::kWhileFits);
  drop_unheld_locked(decision.give_up);
  // What the point starts goes out as one collective per dtype, each
  // parameter once (a tied weight two of the buckets read).
  StartingAhead started;
  std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> by_dtype;
  for (const GatherBucket& next : decision.start) {
    const int64_t before = started.bytes();
    if (!add_ahead_locked(next, started) || started.bytes() == before) continue;
    accounting_.on_graph_prefetch();
    const auto dtype = static_cast<c10::ScalarType>(next.dtype);
    auto group = std::find_if(by_dtype.begin(), by_dtype.end(),
                              [&](const auto& g) { return g.first == dtype; });
    if (group == by_dtype.end()) group = by_dtype.insert(by_dtype.end(), {dtype, {}});
    group->second.insert(group->second.end(), next.ids.begin(), next.ids.end());
  }
  for (const auto& [dtype, ids] : by_dtype) start_gathers_locked(ids, dtype);
}

// The bytes of `ids` in flight or gathered and unheld: what a point started
// ahead and no graph has taken yet.
int64_t Runtime::bytes_gathering_ahead_locked(const std::vector<int64_t>& ids) const {
  int64_t bytes = 0;
  std::unordered_set<int64_t> counted;
  for (int64_t id : ids) {
    if (!counted.insert(id).second) continue;
    const ShardedParam& p = *params_.at(static_cast<size_t>(id));
    const ParamState s = p.state.state();
    if (s == ParamState::Gathering || (s == ParamState::Gathered && p.state.holds() == 0)) {
      bytes += p.layout.padded_numel() * c10::elementSize(p.base.scalar_type());
    }
  }
  return bytes;
}

// Adds what gathering `next` ahead would allocate to `starting`, each
// parameter once; false if one of them is held or in flight in another
// dtype (this graph reads it so: the next graph's gather of it must wait
// for its release, not start now).
bool Runtime::add_ahead_locked(const GatherBucket& next, StartingAhead& starting) const {
  const auto dtype = static_cast<c10::ScalarType>(next.dtype);
  for (int64_t id : next.ids) {
    const ShardedParam& p = *params_.at(static_cast<size_t>(id));
    const ParamState s = p.state.state();
    const bool busy = s == ParamState::Gathering || (s == ParamState::Gathered &&
                                                     p.state.holds() > 0);
    if (busy && p.base.scalar_type() != dtype) return false;
    if (!needs_gather(p, dtype) || !starting.ids.insert(id).second) continue;
    const int64_t bytes = p.layout.padded_numel() * c10::elementSize(dtype);
    auto& [dtype_bytes, params] = starting.by_dtype[next.dtype];
    dtype_bytes += bytes;
    params += 1;
  }
  return true;
}

int64_t Runtime::StartingAhead::bytes() const {
  int64_t total = 0;
  for (const auto& [dtype, sizes] : by_dtype) total += sizes.first;
  return total;
}

// A collective of more than one parameter lands in a staging buffer as
// large as its members before they are copied out (start_gather_locked).
int64_t Runtime::StartingAhead::allocated() const {
  int64_t total = 0;
  for (const auto& [dtype, sizes] : by_dtype) {
    total += sizes.first * (sizes.second > 1 ? 2 : 1);
  }
  return total;
}

// What was gathered ahead whose shards changed since (an optimizer step came
// between two passes) would serve old values: it is given up, and the graph
// that wants those parameters gathers them anew.
void Runtime::give_up_changed_ahead_locked() {
  for (GatherOrder* order : {&forward_graphs_, &backward_graphs_}) {
    give_up_changed_ahead_locked(*order);
  }
}

void Runtime::give_up_changed_ahead_locked(GatherOrder& order) {
  for (int64_t id : order.ahead()) {
    const ShardedParam& p = param(id);
    const ParamState s = p.state.state();
    const bool ours = s == ParamState::Gathering || (s == ParamState::Gathered &&
                                                     p.state.holds() == 0);
    if (ours && p.shard_changed()) {
      drop_unheld_locked(order.give_up_ahead());
      return;
    }
  }
}

void Runtime::give_up_changed_ahead(GatherOrder& order) {
  std::lock_guard<std::mutex> lock(mutex_);
  give_up_changed_ahead_locked(order);
}

// The backward pass's end is a point every rank reaches alike: what a
// backward graph gathered ahead and nobody took is freed there, the next
// pass's first graph is not taken for a follower of this one's last, and the
// eager backward's holds, units and prefetch pass end (EagerScope). One
// callback serves both paths.
void Runtime::queue_end_of_backward_locked() {
  if (end_of_backward_queued_) return;
  c10::weak_intrusive_ptr<Runtime> weak = weak_self();
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto runtime = weak.lock()) runtime->end_backward_pass();
    });
    end_of_backward_queued_ = true;
  } catch (const c10::Error&) {
    // Not inside the autograd engine (a backward graph run by hand, a saved
    // tensor unpacked outside backward): the next graph of the other kind
    // or a changed shard gives up what was gathered ahead, and the next
    // backward's end drops the eager holds.
  }
}

void Runtime::queue_end_of_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_end_of_backward_locked();
}

void Runtime::begin_eager_forward() {
  if (torch::autograd::get_current_graph_task_id() != -1) return;  // recomputed in backward
  drop_late_reductions();
  std::lock_guard<std::mutex> lock(mutex_);
  end_of_backward_queued_ = false;
}

int64_t Runtime::backward_ends() {
  std::lock_guard<std::mutex> lock(mutex_);
  return backward_ends_;
}

c10::weak_intrusive_ptr<Runtime> Runtime::weak_self() {
  return c10::weak_intrusive_ptr<Runtime>(
      c10::intrusive_ptr<Runtime>::unsafe_reclaim_from_nonowning(this));
}

void Runtime::begin_forward_graph(const std::vector<at::Tensor>& inputs) {
  drop_late_reductions();
  std::lock_guard<std::mutex> lock(mutex_);
  // A backward that raised never ran its final callbacks: a forward means
  // whatever backward queued one is over, so the next one queues its own.
  end_of_backward_queued_ = false;
  if (forward_dataflow_.begin_graph(inputs, backward_ends_)) return;  // the pass goes on
  drop_unheld_locked(forward_graphs_.end_pass());
  // A forward outside any backward: a backward whose end-of-backward call
  // never came (run by hand, or raised) is over too.
  if (torch::autograd::get_current_graph_task_id() == -1) {
    drop_unheld_locked(backward_graphs_.end_pass());
  }
}

void Runtime::end_forward_graph(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  forward_dataflow_.graph_returned(outputs);
}

void Runtime::end_backward_pass() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    end_of_backward_queued_ = false;
    ++backward_ends_;
    drop_unheld_locked(backward_graphs_.end_pass());
  }
  eager_scope_.end_backward();  // gathers and reduces: outside the lock
}

}  // namespace sharc
