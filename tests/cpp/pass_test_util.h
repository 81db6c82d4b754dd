#pragma once
// Text-in / text-out helpers for pass tests.

#include <string>

#include <gtest/gtest.h>

#include "sharc/compiler/ir.h"
#include "sharc/compiler/pass.h"

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

/// A graph with no parameters, gradients or gathers: every pass leaves it as
/// it is and reports 0 rewrites.
inline void expect_nothing_to_do(Pass& pass) {
  const char* in = "%x = input bytes=4\noutput %x\n";
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(pass, in, &rewrites), canonical(in));
  EXPECT_EQ(rewrites, 0);
}

}  // namespace sharc::ir::testing
