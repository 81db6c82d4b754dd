#pragma once
// A pass pipeline as text: what a dumped schedule records beside its IR,
// and what sharc-opt and CompileConfig(pipeline=...) run again.
//
//   pipeline := pass (',' pass)*
//   pass     := ['-'] name ['{' key '=' value (',' key '=' value)* '}']
//
// For example
//
//   regather_in_backward,cast_before_gather,check_memory_budget{budget=65536},
//   -keep_gathered_params,bucket_allgathers{bytes=16384,budget=65536}
//
// A leading '-' switches a pass off; it stays listed, so the pass manager
// can name it when the schedule needs it. Values are integers, decimals,
// `none` (an option left unset) or lists of integers joined by ':'
// (`candidates=0:3:5`). Spaces and line breaks between items are ignored.
// Each pass's arguments are those of its factory in passes.h; make_pass
// rejects an unknown pass or argument by name.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sharc/compiler/pass.h"

namespace sharc::ir {

struct PassSpec {
  std::string name;
  bool enabled = true;
  std::map<std::string, std::string> args = {};  ///< key -> value, as written
};

using PipelineSpec = std::vector<PassSpec>;

/// Parses the text form; throws sharc::Error naming what is wrong.
PipelineSpec parse_pipeline(const std::string& text);
/// The text form; parse_pipeline(print_pipeline(p)) == p.
std::string print_pipeline(const PipelineSpec& pipeline);

/// The pass a spec names, built with its arguments; throws sharc::Error
/// naming an unknown pass (and the known ones) or argument (and the pass's
/// arguments), or a bad value.
std::unique_ptr<Pass> make_pass(const PassSpec& spec);

/// A value's text: shortest decimal that reads back to the same double.
std::string format_number(double value);

}  // namespace sharc::ir
