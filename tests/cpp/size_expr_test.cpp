// Symbolic sizes: the expression grammar Dynamo's sizes are written in.

#include <gtest/gtest.h>

#include "sharc/compiler/size_expr.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

int64_t eval(const std::string& text, const SizeBindings& b = {}) {
  return SizeExpr::parse(text).evaluate(b);
}

TEST(SizeExpr, ArithmeticWithPrecedence) {
  EXPECT_EQ(eval("2 + 3*4"), 14);
  EXPECT_EQ(eval("(2 + 3)*4"), 20);
  EXPECT_EQ(eval("2*3**2"), 18);
  EXPECT_EQ(eval("2**3**2"), 512);  // right-associative
  EXPECT_EQ(eval("-2**2"), -4);     // unary minus binds looser than **
  EXPECT_EQ(eval("10 - 4 - 3"), 3); // left-associative
}

TEST(SizeExpr, FloorDivisionAndModuloArePythons) {
  EXPECT_EQ(eval("7//2"), 3);
  EXPECT_EQ(eval("-7//2"), -4);
  EXPECT_EQ(eval("7 % 3"), 1);
  EXPECT_EQ(eval("-7 % 3"), 2);
  EXPECT_EQ(eval("7 % -3"), -2);
  EXPECT_THROW(eval("1//0"), Error);
  EXPECT_THROW(eval("1 % 0"), Error);
}

TEST(SizeExpr, SymbolsAndFunctions) {
  const SizeExpr e = SizeExpr::parse("4*s13**2 + Max(1, s0 - 2) + Min(s0, u1, 3)");
  EXPECT_EQ(e.symbols(), (std::set<std::string>{"s0", "s13", "u1"}));
  EXPECT_FALSE(e.is_constant());
  EXPECT_EQ(e.evaluate({{"s13", 24}, {"s0", 16}, {"u1", 2}}), 4 * 576 + 14 + 2);
  EXPECT_EQ(e.evaluate({{"s13", 1}, {"s0", 1}, {"u1", 9}}), 4 + 1 + 1);
  EXPECT_TRUE(SizeExpr::parse("3*(2 + 5)").is_constant());
}

TEST(SizeExpr, WhatTorchPrintsForConvolutionSizes) {
  // str() of the byte size of a stride-2 convolution's output over s0 x s0.
  EXPECT_EQ(eval("4*((s0 - 1)//2 + 1)**2*8", {{"s0", 17}}), 4 * 81 * 8);
}

TEST(SizeExpr, BadTextNamesThePosition) {
  for (const char* bad : {"", "2 +", "s0 * * 2", "(1", "Max 1", "Max()", "1 2", "s0 - -",
                          "3.5", "99999999999999999999", "a$b"}) {
    try {
      SizeExpr::parse(bad);
      ADD_FAILURE() << "parsed '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("at position"), std::string::npos) << e.what();
    }
  }
}

TEST(SizeExpr, DeepNestingIsRefusedNotAStackOverflow) {
  EXPECT_EQ(eval(std::string(100, '(') + "7" + std::string(100, ')')), 7);
  EXPECT_THROW(SizeExpr::parse(std::string(100000, '(') + "1"), Error);
  EXPECT_THROW(SizeExpr::parse(std::string(100000, '-') + "1"), Error);
}

TEST(SizeExpr, UnboundSymbolsAndOverflowRaise) {
  EXPECT_THROW(eval("s0 + 1"), Error);
  EXPECT_THROW(eval("2**64"), Error);
  EXPECT_THROW(eval("9223372036854775807 + 1"), Error);
  EXPECT_THROW(eval("2**-1"), Error);
  EXPECT_EQ(eval("1**9223372036854775807"), 1);  // fast, by squaring
  EXPECT_EQ(eval("0**0"), 1);
}

}  // namespace
}  // namespace sharc::ir
