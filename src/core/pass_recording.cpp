// The order of one kind of eager pass: see [Note: eager prefetch].

#include "sharc/core/pass_recording.h"

namespace sharc {

void PassRecording::Recording::add(int64_t key, int64_t id) {
  if (where.count(id)) return;  // gathered again (a tied or re-read weight): its first group stands
  auto [it, fresh] = keys.emplace(key, static_cast<int64_t>(groups.size()));
  if (fresh) groups.emplace_back();
  groups[it->second].push_back(id);
  where[id] = it->second;
}

std::vector<std::vector<int64_t>> PassRecording::on_gather(int64_t key, int64_t id) {
  if (excluded_.count(id)) return {};
  now_.add(key, id);
  const int64_t group = group_of(id);
  if (group < 0) return {};
  std::vector<std::vector<int64_t>> to_start;
  for (int64_t index : {group, group + 1}) {
    if (index >= static_cast<int64_t>(last_.groups.size()) || !started_.insert(index).second) {
      continue;
    }
    const std::vector<int64_t>& ids = last_.groups[index];
    touched_.insert(touched_.end(), ids.begin(), ids.end());
    to_start.push_back(ids);
  }
  return to_start;
}

int64_t PassRecording::group_of(int64_t id) const {
  auto it = last_.where.find(id);
  return it == last_.where.end() ? -1 : it->second;
}

std::vector<int64_t> PassRecording::finish() {
  if (!now_.groups.empty()) last_ = std::move(now_);
  now_ = Recording();
  started_.clear();
  std::vector<int64_t> touched = std::move(touched_);
  touched_.clear();
  return touched;
}

}  // namespace sharc
