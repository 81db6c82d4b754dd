// The order of one kind of pass: see [Note: gather order].

#include "sharc/core/gather_order.h"

#include <algorithm>

namespace sharc {
namespace {

bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

bool holds_all(const GatherBucket& step, const std::vector<int64_t>& ids) {
  return std::all_of(ids.begin(), ids.end(), [&](int64_t id) { return contains(step.ids, id); });
}

}  // namespace

bool GatherOrder::Recording::add(int64_t name, const GatherBucket& bucket) {
  auto [it, fresh] = named.emplace(name, static_cast<int64_t>(steps.size()));
  if (fresh) steps.push_back(GatherBucket{{}, bucket.dtype});
  GatherBucket& step = steps[it->second];
  bool added = false;
  for (int64_t id : bucket.ids) {
    if (contains(step.ids, id)) continue;  // read again in its step: one gather
    step.ids.push_back(id);
    where[id].push_back(it->second);
    added = true;
  }
  return added;
}

GatherOrder::Decision GatherOrder::gather(int64_t step, const GatherBucket& bucket,
                                          const Fits& fits) {
  GatherBucket asked{{}, bucket.dtype};
  for (int64_t id : bucket.ids) {
    if (!excluded_.count(id)) asked.ids.push_back(id);
  }
  Decision decision;
  if (asked.ids.empty()) return decision;
  decision.give_up = take(asked);
  if (!now_.add(step, asked)) return decision;
  const std::optional<int64_t> found = find(asked.ids);
  if (!found) return decision;
  for (int64_t id : asked.ids) found_.emplace(*found, id);
  at_ = std::max(at_, *found);
  start(*found, -1, asked, fits, decision);  // the rest of its step
  return decision;
}

GatherOrder::Decision GatherOrder::reached(const std::vector<int64_t>& ids, const Fits& fits,
                                           Reach reach) {
  Decision decision;
  if (ids.empty() || std::any_of(ids.begin(), ids.end(),
                                 [this](int64_t id) { return excluded_.count(id) > 0; })) {
    return decision;  // not a point of this order: only some ranks may reach it
  }
  const std::optional<int64_t> point = gathered_in(ids);
  give_up_passed(point, decision);
  if (!point) return decision;
  for (int64_t next = *point + 1; start(next, next - 1, GatherBucket{}, fits, decision); ++next) {
    if (reach == Reach::kNextStep) break;
  }
  return decision;
}

std::vector<int64_t> GatherOrder::end_pass() {
  std::vector<int64_t> left = give_up_ahead();
  if (!now_.steps.empty()) last_ = std::move(now_);
  now_ = Recording();
  started_.clear();
  found_.clear();
  at_ = -1;
  return left;
}

std::vector<int64_t> GatherOrder::give_up_ahead() {
  std::vector<int64_t> left = ahead();
  ahead_.clear();
  return left;
}

std::vector<int64_t> GatherOrder::ahead() const {
  std::vector<int64_t> left;
  for (const Ahead& a : ahead_) left.insert(left.end(), a.left.ids.begin(), a.left.ids.end());
  return left;
}

int64_t GatherOrder::step_of(int64_t id) const {
  auto it = last_.where.find(id);
  if (it == last_.where.end()) return -1;
  return *std::min_element(it->second.begin(), it->second.end());
}

// The step of the last pass a gather of `ids` falls in: the nearest from
// where the pass is that holds them and has not gathered them yet in this
// pass (a graph run in a loop is one step per run); else the first such
// step (a parent module reads its own parameters after its children's).
std::optional<int64_t> GatherOrder::find(const std::vector<int64_t>& ids) const {
  auto it = last_.where.find(ids.front());
  if (it == last_.where.end()) return std::nullopt;
  std::optional<int64_t> nearest, first;
  for (int64_t step : it->second) {
    const bool open = holds_all(last_.steps[step], ids) &&
                      std::none_of(ids.begin(), ids.end(),
                                   [&](int64_t id) { return found_.count({step, id}) > 0; });
    if (!open) continue;
    if (!first || step < *first) first = step;
    if (step >= at_ && (!nearest || step < *nearest)) nearest = step;
  }
  return nearest ? nearest : first;
}

// The latest step of the last pass that this pass gathered all of `ids` in.
std::optional<int64_t> GatherOrder::gathered_in(const std::vector<int64_t>& ids) const {
  auto it = last_.where.find(ids.front());
  if (it == last_.where.end()) return std::nullopt;
  std::optional<int64_t> latest;
  for (int64_t step : it->second) {
    const bool gathered = std::all_of(ids.begin(), ids.end(),
                                      [&](int64_t id) { return found_.count({step, id}) > 0; });
    if (gathered && (!latest || step > *latest)) latest = step;
  }
  return latest;
}

// A gather takes the parameters it shares with what was started ahead in
// its dtype; what was started ahead in another dtype is given up first.
std::vector<int64_t> GatherOrder::take(const GatherBucket& bucket) {
  std::vector<int64_t> give_up;
  for (Ahead& a : ahead_) {
    std::vector<int64_t> left;
    for (int64_t id : a.left.ids) {
      if (!contains(bucket.ids, id)) left.push_back(id);
    }
    if (left.size() == a.left.ids.size()) continue;
    if (a.left.dtype != bucket.dtype) {
      give_up.insert(give_up.end(), a.left.ids.begin(), a.left.ids.end());
      left.clear();
    }
    a.left.ids = std::move(left);
    a.taken_any = true;
  }
  forget_empty();
  return give_up;
}

// Starts step `step` of the last pass (once a pass), less what `asked`
// gathers now in the step's dtype, if it fits; `after` is the step whose
// point starts it (-1: a gather in it).
bool GatherOrder::start(int64_t step, int64_t after, const GatherBucket& asked, const Fits& fits,
                        Decision& decision) {
  if (step >= static_cast<int64_t>(last_.steps.size())) return false;
  if (started_.count(step)) return true;
  GatherBucket bucket{{}, last_.steps[step].dtype};
  for (int64_t id : last_.steps[step].ids) {
    if (!excluded_.count(id)) bucket.ids.push_back(id);
  }
  Ahead ahead{GatherBucket{{}, bucket.dtype}, after};
  for (int64_t id : bucket.ids) {
    if (!contains(asked.ids, id)) ahead.left.ids.push_back(id);
  }
  if (ahead.left.ids.empty()) {  // the gather asked for is the whole step
    started_.insert(step);
    return true;
  }
  // The asked gather joins the step's collective when their dtypes agree.
  GatherBucket to_start = asked.dtype == bucket.dtype ? bucket : ahead.left;
  if (fits && !fits(to_start)) return false;  // a later point may find room
  started_.insert(step);
  ahead_.push_back(std::move(ahead));
  decision.start.push_back(std::move(to_start));
  return true;
}

// At a point after step `point` (none: a gather this order has not seen),
// what a point before it started and nothing took was for another path.
void GatherOrder::give_up_passed(std::optional<int64_t> point, Decision& decision) {
  for (Ahead& a : ahead_) {
    if (a.after < 0 || a.taken_any || (point && a.after >= *point)) continue;
    decision.give_up.insert(decision.give_up.end(), a.left.ids.begin(), a.left.ids.end());
    a.left.ids.clear();
  }
  forget_empty();
}

void GatherOrder::forget_empty() {
  ahead_.erase(std::remove_if(ahead_.begin(), ahead_.end(),
                              [](const Ahead& a) { return a.left.ids.empty(); }),
               ahead_.end());
}

}  // namespace sharc
