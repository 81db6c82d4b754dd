#pragma once
// The life cycle of one sharded parameter's gathered (full) buffer.
//
//   Sharded --begin_gather--> Gathering --finish_gather--> Gathered
//      Gathered --release (last hold)--> Released --begin_gather--> Gathering
//
// While Gathered, the buffer is shared by holds: every acquire() adds one and
// every release() drops one; the buffer is freed when the last hold goes, so a
// parameter used several times (or tied into several modules) is freed once,
// after its last use. A persistent parameter keeps its buffer at zero holds.
// Misuse (releasing what is not gathered, waiting twice, ...) throws
// sharc::Error with a message naming the parameter and both states.

#include <cstdint>
#include <string>

namespace sharc {

enum class ParamState { Sharded, Gathering, Gathered, Released };

const char* to_string(ParamState state);

class ParamStateMachine {
 public:
  explicit ParamStateMachine(std::string name);

  /// Sharded|Released -> Gathering: a collective into the buffer is in flight.
  void begin_gather();
  /// Gathering -> Gathered with no holds yet.
  void finish_gather();
  /// Gathered at zero holds -> Gathering: a persistent parameter whose shard
  /// has changed (optimizer step) is gathered again into the buffer it keeps.
  void begin_refresh();
  /// Gathered: one more user holds the buffer.
  void acquire();
  /// Gathered: one user lets go. Returns true when the buffer must be freed
  /// now (last hold of a non-persistent parameter); the state is then Released.
  bool release();

  /// Persistent parameters stay Gathered at zero holds (selective unsharding).
  void set_persistent(bool persistent);

  ParamState state() const { return state_; }
  int64_t holds() const { return holds_; }
  bool persistent() const { return persistent_; }
  bool is_gathered() const { return state_ == ParamState::Gathered; }
  const std::string& name() const { return name_; }

 private:
  void expect(bool ok, const char* action, const char* expected) const;

  std::string name_;
  ParamState state_ = ParamState::Sharded;
  int64_t holds_ = 0;
  bool persistent_ = false;
};

}  // namespace sharc
