// Parser and printer: text in, text out.

#include <gtest/gtest.h>

#include "sharc/core/error.h"
#include "sharc/compiler/ir.h"

namespace sharc::ir {
namespace {

const char* kScheduled = R"(
param @0 "fc.weight" bytes=4096
param @1 "fc.bias" bytes=64   # a comment
%x = input bytes=256
%g = gather @0 @1
%w, %b = wait %g
%y = compute "addmm" %b %x %w bytes=256 cost=1.5
release @0 @1 after %y
output %y
)";

TEST(IrText, PrintsCanonicalForm) {
  EXPECT_EQ(print(parse(kScheduled)),
            "param @0 \"fc.weight\" bytes=4096\n"
            "param @1 \"fc.bias\" bytes=64\n"
            "%x = input bytes=256\n"
            "%g = gather @0 @1\n"
            "%w, %b = wait %g\n"
            "%y = compute \"addmm\" %b %x %w bytes=256 cost=1.5\n"
            "release @0 @1 after %y\n"
            "output %y\n");
}

TEST(IrText, RoundTrips) {
  const std::string once = print(parse(kScheduled));
  EXPECT_EQ(print(parse(once)), once);
}

TEST(IrText, ParsesStructure) {
  const Graph g = parse(kScheduled);
  ASSERT_EQ(g.params.size(), 2u);
  EXPECT_EQ(g.params.at(0).name, "fc.weight");
  ASSERT_EQ(g.nodes.size(), 6u);
  EXPECT_EQ(g.nodes[1].kind, NodeKind::Gather);
  EXPECT_EQ(g.nodes[1].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(g.nodes[2].outputs, (std::vector<std::string>{"w", "b"}));
  EXPECT_EQ(g.nodes[3].op, "addmm");
  EXPECT_DOUBLE_EQ(*g.nodes[3].cost, 1.5);
  EXPECT_EQ(g.value_bytes("w"), 4096);
  EXPECT_EQ(g.value_bytes("b"), 64);
  EXPECT_EQ(g.value_bytes("y"), 256);
  EXPECT_THROW(g.value_bytes("nope"), Error);
}

TEST(IrText, DirectParameterReadsAndGradients) {
  const Graph g = parse(
      "param @0 \"w\" bytes=16\n"
      "%saved = input param=@0\n"
      "%dw = compute \"mm\" %saved @0 bytes=16 grad=@0\n"
      "%r = reduce_scatter @0 %dw\n");
  EXPECT_EQ(g.nodes[0].params, (std::vector<int64_t>{0}));
  EXPECT_TRUE(g.nodes[1].operands[1].is_param());
  EXPECT_EQ(*g.nodes[1].grad_of, 0);
  EXPECT_EQ(print(g),
            "param @0 \"w\" bytes=16\n"
            "%saved = input param=@0\n"
            "%dw = compute \"mm\" %saved @0 bytes=16 grad=@0\n"
            "%r = reduce_scatter @0 %dw\n");
}

TEST(IrText, ReductionsAndTheirWaits) {
  const char* text =
      "param @0 \"w\" bytes=16\n"
      "param @1 \"b\" bytes=4\n"
      "%x = input bytes=4\n"
      "%dw = compute \"mm\" %x bytes=16 grad=@0\n"
      "%db = compute \"sum\" %x bytes=4 grad=@1\n"
      "%r = reduce_scatter @0 @1 %dw %db\n"
      "%sw, %sb = wait_reduce %r\n"
      "output %x %sw %sb\n";
  const Graph g = parse(text);
  EXPECT_EQ(g.nodes[3].kind, NodeKind::ReduceScatter);
  EXPECT_EQ(g.nodes[3].outputs, (std::vector<std::string>{"r"}));
  EXPECT_EQ(g.nodes[3].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(g.nodes[4].kind, NodeKind::WaitReduce);
  EXPECT_STREQ(to_string(g.nodes[4].kind), "wait_reduce");
  EXPECT_EQ(g.nodes[4].outputs, (std::vector<std::string>{"sw", "sb"}));
  EXPECT_EQ(g.nodes[4].operands[0].value, "r");
  EXPECT_TRUE(g.nodes[4].params.empty());
  EXPECT_EQ(g.value_bytes("r"), 0);   // a token
  EXPECT_EQ(g.value_bytes("sw"), 0);  // a shard's size is the world size's business
  EXPECT_EQ(print(g), text);
}

TEST(IrText, DtypesAndCasts) {
  const Graph g = parse(
      "param @0 \"w\" dtype=float32 bytes=4096\n"
      "param @1 \"b\" bytes=64\n"
      "%wb = compute \"convert\" @0 cost=2 cast=bfloat16 bytes=2048\n"
      "output %wb\n");
  EXPECT_EQ(g.params.at(0).dtype, "float32");
  EXPECT_EQ(g.params.at(0).bytes, 4096);
  EXPECT_FALSE(g.params.at(1).dtype.has_value());
  EXPECT_EQ(g.nodes[0].cast, "bfloat16");
  EXPECT_FALSE(g.nodes[1].cast.has_value());
  EXPECT_EQ(print(g),
            "param @0 \"w\" bytes=4096 dtype=float32\n"
            "param @1 \"b\" bytes=64\n"
            "%wb = compute \"convert\" @0 bytes=2048 cast=bfloat16 cost=2\n"
            "output %wb\n");
  EXPECT_EQ(print(parse(print(g))), print(g));
}

// Parses `text`, which must fail, and returns the message.
std::string parse_error(const std::string& text) {
  try {
    parse(text);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed: " << text;
  return "";
}

TEST(IrText, BadDtypesAndParamLinesNameTheLineAndTheForm) {
  const std::string head = "param @0 \"w\" bytes=4\n";
  EXPECT_EQ(parse_error(head + "param @1 \"v\" dtype=float32\n"),
            "sharc ir line 2: missing 'bytes='; expected 'param @N \"name\" bytes=B [dtype=D] [kept]'");
  EXPECT_EQ(parse_error(head + "param @1 \"v\" bytes=4 bytes=8\n"),
            "sharc ir line 2: 'bytes=' given twice");
  EXPECT_EQ(parse_error(head + "param @1 \"v\" dtype=float32 bytes=4 dtype=float16\n"),
            "sharc ir line 2: 'dtype=' given twice");
  EXPECT_EQ(parse_error(head + "param @1 \"v\" bytes=4 shape=2\n"),
            "sharc ir line 2: unknown parameter attribute 'shape'; expected "
            "'param @N \"name\" bytes=B [dtype=D] [kept]'");
  EXPECT_EQ(parse_error(head + "param @1 \"v\" bytes=4 float32\n"),
            "sharc ir line 2: unexpected 'float32'; expected "
            "'param @N \"name\" bytes=B [dtype=D] [kept]'");
  EXPECT_EQ(parse_error(head + "param @1 \"v\" bytes=4 dtype=torch.float32\n"),
            "sharc ir line 2: bad dtype 'torch.float32'; expected a name like float32 or "
            "bfloat16");
  EXPECT_EQ(parse_error("param @1 \"v\" bytes=4 dtype=\n"),
            "sharc ir line 1: bad dtype ''; expected a name like float32 or bfloat16");
  EXPECT_EQ(parse_error("param @1 bytes=4\n"),
            "sharc ir line 1: expected 'param @N \"name\" bytes=B [dtype=D] [kept]'");
  EXPECT_EQ(parse_error("%x = input bytes=4 cast=bfloat16\n"),
            "sharc ir line 1: only compute nodes take 'cast=' (a conversion of the operand), "
            "not input nodes");
  EXPECT_EQ(parse_error("%x = compute \"c\" @0 cast=@1\n"),
            "sharc ir line 1: bad dtype '@1'; expected a name like float32 or bfloat16");
  EXPECT_EQ(parse_error("%x = compute \"c\" @0 dtype=float32\n"),
            "sharc ir line 1: unknown attribute 'dtype'");
}

TEST(IrText, BadInputNamesTheLine) {
  try {
    parse("%x = input bytes=4\n%y = frobnicate %x\n");
    FAIL() << "unknown node kinds must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("frobnicate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse("param @0 \"w\" bytes=4\nparam @0 \"v\" bytes=4\n"), Error);
  EXPECT_THROW(parse("%x = compute \"mm\" bogus=1\n"), Error);
  EXPECT_THROW(parse("%g = gather @x\n"), Error);
  EXPECT_THROW(parse("%x = input bytes=lots\n"), Error);
  EXPECT_THROW(parse("%x = compute \"a\" cost=\n"), Error);
  EXPECT_THROW(parse("%x = compute \"unterminated\n"), Error);
}

// A graph compiled with dynamic shapes: what the bridge writes for a
// 2-layer model over a sequence of length s0 (hint 16) and a convolution's
// output size, which torch prints with spaces and minus signs.
const char* kSymbolic = R"(
param @0 "fc.weight" bytes=4096
size s0 hint=16
size u0
%x = input bytes=1024 sym="64*s0"
%y = compute "mm" %x @0 bytes=2048 sym="128*s0" cost=2
%z = compute "conv" %y bytes=3136 sym="4*(s0 - 2)**2*4"
%k = compute "nonzero" %z bytes=0 sym="8*u0"
%dw = compute "mm" %x %y bytes=4096 grad=@0
output %z %k
)";

TEST(IrText, SymbolicSizesRoundTrip) {
  const Graph g = parse(kSymbolic);
  EXPECT_EQ(g.size_symbols.at("s0"), std::optional<int64_t>(16));
  EXPECT_FALSE(g.size_symbols.at("u0").has_value());
  EXPECT_EQ(*g.nodes[1].bytes_expr, "128*s0");
  EXPECT_EQ(*g.nodes[2].bytes_expr, "4*(s0 - 2)**2*4");
  EXPECT_FALSE(g.nodes[4].bytes_expr.has_value());
  const std::string once = print(g);
  EXPECT_NE(once.find("size s0 hint=16\nsize u0\n"), std::string::npos) << once;
  EXPECT_NE(once.find("bytes=1024 sym=\"64*s0\"\n"), std::string::npos) << once;
  EXPECT_NE(once.find("bytes=0 sym=\"8*u0\"\n"), std::string::npos) << once;
  EXPECT_EQ(print(parse(once)), once);
}

TEST(IrText, SymbolicValueBytesAtHintsAndAtOtherSizes) {
  const Graph g = parse(kSymbolic);
  EXPECT_EQ(g.value_bytes("y"), 2048);                 // the hint
  EXPECT_EQ(g.value_bytes("y", {{"s0", 40}}), 5120);   // another length
  EXPECT_EQ(g.value_bytes("z", {{"s0", 24}}), 16 * 22 * 22);
  EXPECT_EQ(g.value_bytes("dw", {{"s0", 40}}), 4096);  // static
  EXPECT_EQ(g.value_bytes("k", {{"u0", 3}}), 24);
  EXPECT_THROW(g.value_bytes("k", {}), Error);  // u0 has no hint
  EXPECT_EQ(g.size_hints(), (SizeBindings{{"s0", 16}}));
}

TEST(IrText, BadSymbolicSizesNameTheLine) {
  for (const char* bad : {"%x = input bytes=4 sym=\"4*\"\n", "%x = input bytes=4 sym=4\n",
                          "%x = input bytes=4 sym=\"s0\n", "size 3 hint=1\n",
                          "size Max\n", "size s0 hint=x\n", "size s0 bogus=1\n",
                          "size s0\nsize s0\n", "size\n"}) {
    try {
      parse(bad);
      ADD_FAILURE() << "parsed: " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("line "), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace sharc::ir
