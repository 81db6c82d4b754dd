#include "sharc/core/param_state.h"

#include <utility>

#include "sharc/core/error.h"

namespace sharc {

const char* to_string(ParamState state) {
  switch (state) {
    case ParamState::Sharded:
      return "sharded";
    case ParamState::Gathering:
      return "gathering";
    case ParamState::Gathered:
      return "gathered";
    case ParamState::Released:
      return "released";
  }
  return "unknown";
}

ParamStateMachine::ParamStateMachine(std::string name) : name_(std::move(name)) {}

void ParamStateMachine::expect(bool ok, const char* action,
                               const char* expected) const {
  SHARC_CHECK(ok, "sharc: cannot ", action, " parameter '", name_,
              "': it is ", to_string(state_), ", expected ", expected);
}

void ParamStateMachine::begin_gather() {
  expect(state_ == ParamState::Sharded || state_ == ParamState::Released,
         "start gathering", "sharded or released (wait for the gather already "
         "in flight instead of starting another)");
  state_ = ParamState::Gathering;
}

void ParamStateMachine::finish_gather() {
  expect(state_ == ParamState::Gathering, "finish gathering",
         "gathering (start a gather before waiting on it)");
  state_ = ParamState::Gathered;
  holds_ = 0;
}

void ParamStateMachine::begin_refresh() {
  expect(state_ == ParamState::Gathered && holds_ == 0, "refresh",
         "gathered with no holds (a buffer in use cannot be overwritten)");
  state_ = ParamState::Gathering;
}

void ParamStateMachine::acquire() {
  expect(state_ == ParamState::Gathered, "use",
         "gathered (gather and wait before use)");
  ++holds_;
}

bool ParamStateMachine::release() {
  expect(state_ == ParamState::Gathered && holds_ > 0, "release",
         "gathered and held (each release must match one gather)");
  --holds_;
  if (holds_ > 0 || persistent_) {
    return false;
  }
  state_ = ParamState::Released;
  return true;
}

void ParamStateMachine::set_persistent(bool persistent) { persistent_ = persistent; }

}  // namespace sharc
