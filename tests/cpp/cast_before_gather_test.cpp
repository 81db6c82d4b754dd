// cast_before_gather: a parameter read only through casts to one smaller
// floating dtype is gathered in that dtype; any other read keeps it full.

#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/pipeline.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

// Runs the pass on `in`; expects `expected` and `rewrites` removed casts.
void expect_fused(const std::string& in, const std::string& expected, int64_t rewrites) {
  auto pass = make_cast_before_gather();
  int64_t n = -1;
  const std::string out = run_pass(*pass, in, &n);
  EXPECT_EQ(out, canonical(expected));
  EXPECT_EQ(n, rewrites);
  const auto errors = verify(parse(out), VerifyOptions::structural());
  EXPECT_TRUE(errors.empty()) << errors[0];
}

// Runs the pass on `in`; expects it unchanged and 0 rewrites.
void expect_not_fused(const std::string& in) { expect_fused(in, in, 0); }

TEST(CastBeforeGather, ParameterReadOnlyThroughACastIsGatheredInItsDtype) {
  expect_fused(R"(
param @0 "fc.weight" bytes=4096 dtype=float32
%x = input bytes=64
%wb = compute "prims.convert_element_type.default" @0 bytes=2048 cast=bfloat16
%y = compute "mm" %x %wb bytes=32
output %y
)",
               R"(
param @0 "fc.weight" bytes=2048 dtype=bfloat16
%x = input bytes=64
%y = compute "mm" %x @0 bytes=32
output %y
)",
               1);
}

TEST(CastBeforeGather, TwoCastsToTheSameDtypeAreBothRemoved) {
  expect_fused(R"(
param @0 "w" bytes=4096 dtype=float32
%x = input bytes=64
%w1 = compute "convert" @0 bytes=2048 cast=bfloat16
%a = compute "mm" %x %w1 bytes=64
%w2 = compute "convert" @0 bytes=2048 cast=bfloat16
%b = compute "mm" %a %w2 bytes=64
output %b
)",
               R"(
param @0 "w" bytes=2048 dtype=bfloat16
%x = input bytes=64
%a = compute "mm" %x @0 bytes=64
%b = compute "mm" %a @0 bytes=64
output %b
)",
               2);
}

TEST(CastBeforeGather, AViewOfTheCastReadsTheParameterDirectly) {
  expect_fused(R"(
param @0 "w" bytes=4096 dtype=float32
%x = input bytes=64
%wb = compute "convert" @0 bytes=2048 cast=bfloat16
%wt = compute "aten.t.default" %wb bytes=2048
%y = compute "mm" %x %wt bytes=32
output %y
)",
               R"(
param @0 "w" bytes=2048 dtype=bfloat16
%x = input bytes=64
%wt = compute "aten.t.default" @0 bytes=2048
%y = compute "mm" %x %wt bytes=32
output %y
)",
               1);
}

TEST(CastBeforeGather, AGradientProducerReadingTheCastIsRewritten) {
  expect_fused(R"(
param @0 "w" bytes=64 dtype=float32
param @1 "v" bytes=16 dtype=float32
%dy = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%dv = compute "mm" %dy %wb bytes=16 grad=@1
output %dy
)",
               R"(
param @0 "w" bytes=32 dtype=bfloat16
param @1 "v" bytes=16 dtype=float32
%dy = input bytes=16
%dv = compute "mm" %dy @0 bytes=16 grad=@1
output %dy
)",
               1);
}

// A release names values to wait for, never a direct read; the cast read
// only the parameter, so no use of a gathered value went through it.
TEST(CastBeforeGather, AReleaseThatWaitedForARemovedCastNoLongerListsIt) {
  expect_fused(R"(
param @0 "w" bytes=64 dtype=float32
param @1 "b" bytes=8
%x = input bytes=16
%g = gather @1
%b = wait %g
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "add" %x %b bytes=16
release @1 after %y %wb
%z = compute "mm" %y %wb bytes=16
output %z
)",
               R"(
param @0 "w" bytes=32 dtype=bfloat16
param @1 "b" bytes=8
%x = input bytes=16
%g = gather @1
%b = wait %g
%y = compute "add" %x %b bytes=16
release @1 after %y
%z = compute "mm" %y @0 bytes=16
output %z
)",
               1);
}

TEST(CastBeforeGather, EachParameterIsDecidedOnItsOwn) {
  expect_fused(R"(
param @0 "fused" bytes=64 dtype=float32
param @1 "mixed" bytes=64 dtype=float32
%x = input bytes=16
%a = compute "convert" @0 bytes=32 cast=bfloat16
%b = compute "convert" @1 bytes=32 cast=bfloat16
%c = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %a %b %c @1 bytes=16
output %y
)",
               R"(
param @0 "fused" bytes=32 dtype=bfloat16
param @1 "mixed" bytes=64 dtype=float32
%x = input bytes=16
%b = compute "convert" @1 bytes=32 cast=bfloat16
%y = compute "mm" %x @0 %b @0 @1 bytes=16
output %y
)",
               2);
}

// The declaration line a parameter of `dtype` and `bytes` gets when its one
// read casts it to `to`.
std::string declared_after_cast(const std::string& dtype, int64_t bytes, const std::string& to) {
  auto pass = make_cast_before_gather();
  const std::string out = run_pass(
      *pass, "param @0 \"w\" bytes=" + std::to_string(bytes) + " dtype=" + dtype +
                 "\n%c = compute \"convert\" @0 cast=" + to + "\n%y = compute \"relu\" %c\n");
  return out.substr(0, out.find('\n'));
}

TEST(CastBeforeGather, BytesAreExactlyThoseOfTheNewDtype) {
  EXPECT_EQ(declared_after_cast("float32", 4096, "bfloat16"),
            "param @0 \"w\" bytes=2048 dtype=bfloat16");
  EXPECT_EQ(declared_after_cast("float32", 12, "float16"),
            "param @0 \"w\" bytes=6 dtype=float16");
  EXPECT_EQ(declared_after_cast("float64", 24, "float32"),
            "param @0 \"w\" bytes=12 dtype=float32");
  EXPECT_EQ(declared_after_cast("float64", 24, "bfloat16"),
            "param @0 \"w\" bytes=6 dtype=bfloat16");
  EXPECT_EQ(declared_after_cast("float32", 4096, "float8_e4m3fn"),
            "param @0 \"w\" bytes=1024 dtype=float8_e4m3fn");
  EXPECT_EQ(declared_after_cast("float32", 0, "bfloat16"),
            "param @0 \"w\" bytes=0 dtype=bfloat16");
}

TEST(CastBeforeGather, NotFusedWhenAlsoReadInFullPrecision) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %wb bytes=16
%z = compute "mm" %y @0 bytes=16
output %z
)");
}

TEST(CastBeforeGather, NotFusedWhenCastToTwoDtypes) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%a = compute "convert" @0 bytes=32 cast=bfloat16
%b = compute "convert" @0 bytes=32 cast=float16
%y = compute "mm" %x %a %b bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheCastWidens) {
  expect_not_fused(R"(
param @0 "w" bytes=32 dtype=float16
%x = input bytes=16
%w = compute "convert" @0 bytes=64 cast=float32
%y = compute "mm" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheCastKeepsTheElementSize) {
  expect_not_fused(R"(
param @0 "w" bytes=32 dtype=float16
%x = input bytes=16
%w = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheCastIsToAnInteger) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%w = compute "convert" @0 bytes=16 cast=int8
%y = compute "index" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheParameterDtypeIsUnknown) {
  expect_not_fused(R"(
param @0 "w" bytes=64
%x = input bytes=16
%w = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheTargetDtypeIsUnknown) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%w = compute "convert" @0 bytes=16 cast=float8_e4m3fnuz
%y = compute "mm" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheParameterIsNotAFloatingType) {
  expect_not_fused(R"(
param @0 "table" bytes=64 dtype=int64
%x = input bytes=16
%w = compute "convert" @0 bytes=32 cast=int32
%y = compute "index" %x %w bytes=16
output %y
)");
}

TEST(CastBeforeGather, NotFusedWhenTheCastLeavesTheGraph) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %wb bytes=16
output %y %wb
)");
}

TEST(CastBeforeGather, NotFusedWhenTheParameterLeavesTheGraph) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %wb bytes=16
output %y @0
)");
}

TEST(CastBeforeGather, NotFusedWhenForwardSavedTheFullParameter) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%saved = input param=@0
%dy = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%dx = compute "mm" %dy %wb bytes=16
output %dx
)");
}

TEST(CastBeforeGather, NotFusedWhenTheCastReadsMoreThanTheParameter) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%wb = compute "convert_like" @0 %x bytes=32 cast=bfloat16
%y = compute "mm" %x %wb bytes=16
output %y
)");
}

// Removing it would lose the gradient marker (before insert_reduce_scatter
// a gradient is nothing else) or a reduced value.
TEST(CastBeforeGather, NotFusedWhenTheCastIsAGradient) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16 grad=@0
%y = compute "mm" %x %wb bytes=16
output %y
)");
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%wb = compute "convert" @0 bytes=32 cast=bfloat16 grad=@0
%r = reduce_scatter @0 %wb
%dw = wait_reduce %r
output %dw
)");
}

TEST(CastBeforeGather, NotFusedWhenTheGraphGathersTheParameterItself) {
  expect_not_fused(R"(
param @0 "w" bytes=64 dtype=float32
%x = input bytes=16
%g = gather @0
%w = wait %g
%y = compute "mm" %x %w bytes=16
release @0 after %y
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%z = compute "mm" %y %wb bytes=16
output %z
)");
}

TEST(CastBeforeGather, NotFusedWhenTheBytesAreNoWholeNumberOfElements) {
  expect_not_fused(R"(
param @0 "w" bytes=66 dtype=float32
%x = input bytes=16
%wb = compute "convert" @0 bytes=32 cast=bfloat16
%y = compute "mm" %x %wb bytes=16
output %y
)");
}

TEST(CastBeforeGather, MustRunBeforeGathersAreInserted) {
  auto pass = make_cast_before_gather();
  const Contract c = pass->contract();
  EXPECT_TRUE(c.required.empty());
  EXPECT_TRUE(c.established.empty());
  EXPECT_TRUE(c.undone.empty());
  EXPECT_EQ(c.precedes, (std::vector<Rule>{Rule::GathersInserted}));
  EXPECT_EQ(pass->name(), "cast_before_gather");
}

TEST(CastBeforeGather, NothingToDo) {
  auto pass = make_cast_before_gather();
  testing::expect_nothing_to_do(*pass);
}

// A forward graph under bf16 autocast: two weights read only through casts,
// a norm weight read both through a cast and in full precision.
const char* kAutocastForward = R"(
param @0 "fc1.weight" bytes=65536 dtype=float32
param @1 "fc2.weight" bytes=65536 dtype=float32
param @2 "norm.weight" bytes=64 dtype=float32
%x = input bytes=1024
%w1 = compute "prims.convert_element_type.default" @0 bytes=32768 cast=bfloat16
%h = compute "mm" %x %w1 bytes=1024
%w2 = compute "prims.convert_element_type.default" @1 bytes=32768 cast=bfloat16
%y = compute "mm" %h %w2 bytes=1024
%n = compute "prims.convert_element_type.default" @2 bytes=32 cast=bfloat16
%z = compute "mul" %y %n @2 bytes=1024
output %z
)";

// With the default 64 KiB gather buckets, the two halved weights fit one
// bucket; in float32 they would not. The norm weight keeps float32 and its
// cast, in a bucket of its own (another dtype).
TEST(CastBeforeGather, InThePipelineLaterPassesSeeTheSmallerGathers) {
  Graph g = parse(kAutocastForward);
  const auto records = make_pipeline({}).run(g);
  EXPECT_EQ(records[1].name, "cast_before_gather");
  EXPECT_EQ(records[1].rewrites, 2);
  EXPECT_EQ(print(g), canonical(R"(
param @0 "fc1.weight" bytes=32768 dtype=bfloat16
param @1 "fc2.weight" bytes=32768 dtype=bfloat16
param @2 "norm.weight" bytes=64 dtype=float32
%x = input bytes=1024
%sharc_gather_0 = gather @0 @1
%sharc_full_0, %sharc_full_1 = wait %sharc_gather_0
%sharc_gather_2 = gather @2
%h = compute "mm" %x %sharc_full_0 bytes=1024
release @0 after %h
%y = compute "mm" %h %sharc_full_1 bytes=1024
release @1 after %y
%sharc_full_2 = wait %sharc_gather_2
prefetch_next @2 after %y bytes=-1
%n = compute "prims.convert_element_type.default" %sharc_full_2 bytes=32 cast=bfloat16
%z = compute "mul" %y %n %sharc_full_2 bytes=1024
release @2 after %z
prefetch_next @2 after %z bytes=-1
output %z
)"));
  EXPECT_EQ(g.value_bytes("sharc_full_0"), 32768);
  EXPECT_EQ(g.value_bytes("sharc_full_2"), 64);
}

TEST(CastBeforeGather, SwitchedOffEveryParameterIsGatheredInFullPrecision) {
  PipelineOptions options;
  options.disabled_passes = {"cast_before_gather"};
  Graph g = parse(kAutocastForward);
  make_pipeline(options).run(g);
  const std::string out = print(g);
  EXPECT_NE(out.find("param @0 \"fc1.weight\" bytes=65536 dtype=float32\n"), std::string::npos);
  EXPECT_NE(out.find("%sharc_gather_0 = gather @0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("%sharc_gather_1 = gather @1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("%w1 = compute \"prims.convert_element_type.default\" %sharc_full_0 "
                     "bytes=32768 cast=bfloat16\n"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace sharc::ir
