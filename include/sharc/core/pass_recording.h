#pragma once
// The order of one kind of eager pass: the memory behind eager prefetch.
//
// [Note: eager prefetch]
// Without a compiler, a parameter is gathered when code reads it: one
// blocking collective per parameter. After the first step the order is
// known. Each pass (forward, backward) records its gathers as groups: in
// forward the parameters first gathered inside one module's forward, in
// backward the parameters of one forward group in the order backward asked
// for them. In the next pass of that kind, the first gather of a recorded
// group starts that group's gathers as one bucketed collective and the next
// group's as another; the reads then wait on collectives already in
// flight. So one group is gathered ahead, a module-granular prefetch, and a
// group costs one collective instead of one per parameter.
//
// Every rank must issue the same collectives in the same order. The trigger
// is a gather the code asked for, never a module being entered, so modules
// that run on some ranks only (the experts of a gather unit) move nothing;
// parameters of gather units are left out altogether (their unit gathers
// them). A recorded group the pass does not read after all (another path
// through the model) was gathered for nothing: the end of the pass frees
// what nobody took, and the pass's own order becomes the one the next pass
// follows. This class holds the bookkeeping only; the runtime
// (eager_prefetch.h) issues the collectives it asks for.

#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace sharc {

class PassRecording {
 public:
  /// Parameters never prefetched nor recorded (gather units' members).
  void exclude(int64_t id) { excluded_.insert(id); }

  /// The code is about to gather `id`, grouped by `key` in this pass.
  /// Records it and returns the groups of the last pass to start now:
  /// `id`'s group and the one after it, those not started yet in this pass.
  std::vector<std::vector<int64_t>> on_gather(int64_t key, int64_t id);

  /// The group `id` belonged to in the last finished pass, or -1.
  int64_t group_of(int64_t id) const;

  /// The pass is over. Returns the parameters it started ahead (to free
  /// those nobody holds). Its order becomes the one the next pass follows,
  /// unless it gathered nothing (a backward without sharded inputs keeps
  /// the old one).
  std::vector<int64_t> finish();

 private:
  struct Recording {
    std::vector<std::vector<int64_t>> groups;  ///< in the order their first gather came
    std::map<int64_t, int64_t> where;          ///< parameter -> its group's index
    std::map<int64_t, int64_t> keys;           ///< grouping key -> its group's index
    void add(int64_t key, int64_t id);
  };

  std::set<int64_t> excluded_;
  Recording last_;              ///< the last finished pass's groups
  Recording now_;               ///< this pass's, so far
  std::set<int64_t> started_;   ///< groups of last_ started in this pass
  std::vector<int64_t> touched_;  ///< parameters this pass started gathering
};

}  // namespace sharc
