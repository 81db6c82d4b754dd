#pragma once
// Text-in / text-out helpers for pass tests.

#include <string>

#include "sharc/ir.h"
#include "sharc/pass.h"

namespace sharc::ir::testing {

/// Parses `input`, runs `pass` alone and returns the printed result.
inline std::string run_pass(Pass& pass, const std::string& input, int64_t* rewrites = nullptr) {
  Graph graph = parse(input);
  const int64_t n = pass.run(graph);
  if (rewrites) *rewrites = n;
  return print(graph);
}

/// The canonical printed form of `text`.
inline std::string canonical(const std::string& text) { return print(parse(text)); }

}  // namespace sharc::ir::testing
