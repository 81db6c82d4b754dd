#pragma once
// A symbolic size: an integer expression over a graph's size symbols.
//
// When Dynamo compiles a graph with dynamic shapes (torch.compile's
// dynamic=True, mark_dynamic, or its automatic dynamic shapes after a size
// changed), activation sizes are expressions like `4*s0*s1` or
// `2*((s0 - 1)//2) + 2` rather than numbers. The IR keeps such a value's
// size as its hint (the bytes at the sizes the graph was first compiled
// and profiled with) plus the expression, written in this grammar:
//
//   expr  := sum
//   sum   := term (('+' | '-') term)*
//   term  := unary (('*' | '//' | '%') unary)*
//   unary := '-' unary | power
//   power := atom ('**' unary)?                 (right-associative)
//   atom  := integer | symbol | ('Max' | 'Min') '(' expr (',' expr)* ')'
//          | '(' expr ')'
//
// `//` and `%` are Python's floor division and modulo (rounding towards
// minus infinity; the remainder takes the divisor's sign). Symbols are
// identifiers (`s0`, `u3`); spaces are ignored.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

namespace sharc::ir {

/// Values of size symbols.
using SizeBindings = std::map<std::string, int64_t>;

class SizeExpr {
 public:
  /// Parses `text`; throws sharc::Error naming the position on bad input.
  static SizeExpr parse(const std::string& text);

  /// The value with every symbol bound; throws sharc::Error naming a
  /// symbol `bindings` lacks, a division by zero or a negative exponent.
  int64_t evaluate(const SizeBindings& bindings) const;
  /// The symbols the expression reads.
  std::set<std::string> symbols() const;
  /// Whether it reads no symbol (a constant).
  bool is_constant() const { return symbols().empty(); }

  struct Term;  // the parsed tree, defined in size_expr.cpp

 private:
  explicit SizeExpr(std::shared_ptr<const Term> root) : root_(std::move(root)) {}
  std::shared_ptr<const Term> root_;
};

}  // namespace sharc::ir
