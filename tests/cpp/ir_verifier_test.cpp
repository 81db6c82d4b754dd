// The verifier: one rule per test, each with a graph that breaks it.

#include <gtest/gtest.h>

#include "sharc/compiler/ir.h"

namespace sharc::ir {
namespace {

const char* kParams = "param @0 \"w\" bytes=64\nparam @1 \"b\" bytes=8\n";

std::vector<std::string> check(const std::string& body,
                               VerifyOptions options = VerifyOptions::complete()) {
  return verify(parse(std::string(kParams) + body), options);
}

bool mentions(const std::vector<std::string>& errors, const std::string& text) {
  for (const auto& e : errors) {
    if (e.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(IrVerifier, AcceptsAWellFormedForwardAndBackward) {
  const auto errors = check(
      "%x = input bytes=16\n"
      "%g = gather @0\n"
      "%w = wait %g\n"
      "%y = compute \"mm\" %x %w bytes=16\n"
      "%z = compute \"relu\" %y %w bytes=16\n"
      "release @0 after %z\n"
      "%dw = compute \"mm_grad\" %x %z bytes=64 grad=@0\n"
      "%r = reduce_scatter @0 %dw\n"
      "%sw = wait_reduce %r\n"
      "output %z %sw\n");
  EXPECT_TRUE(errors.empty()) << errors[0];
}

TEST(IrVerifier, UseBeforeWait) {
  const auto e = check("%g = gather @0\n%y = compute \"mm\" %g bytes=4\n%w = wait %g\n"
                       "release @0 after %w\n");
  EXPECT_TRUE(mentions(e, "before waiting")) << (e.empty() ? "" : e[0]);
}

TEST(IrVerifier, UseAfterRelease) {
  const auto e = check("%g = gather @0\n%w = wait %g\n%y = compute \"a\" %w bytes=4\n"
                       "release @0 after %y\n%z = compute \"b\" %w bytes=4\n");
  EXPECT_TRUE(mentions(e, "after its release"));
}

TEST(IrVerifier, NeverReleased) {
  const auto e = check("%g = gather @0\n%w = wait %g\n%y = compute \"a\" %w bytes=4\n");
  EXPECT_TRUE(mentions(e, "never released"));
}

TEST(IrVerifier, NeverWaited) {
  const auto e = check("%g = gather @0\n");
  EXPECT_TRUE(mentions(e, "never waited"));
}

TEST(IrVerifier, ReleaseNotTiedToLastUser) {
  const auto e = check("%g = gather @0\n%w = wait %g\n%y = compute \"a\" %w bytes=4\n"
                       "%z = compute \"b\" %w bytes=4\nrelease @0 after %y\n");
  EXPECT_TRUE(mentions(e, "does not depend on its user (node 3)")) << (e.empty() ? "" : e[0]);
}

// Depending on the last user alone is not enough: Inductor may compute an
// earlier, fused use after the release.
TEST(IrVerifier, ReleaseNotTiedToAnEarlierUser) {
  const std::string text = "%g = gather @0\n%w = wait %g\n%y = compute \"a\" %w bytes=4\n"
                           "%z = compute \"b\" %w bytes=4\n";
  auto e = check(text + "release @0 after %z\n");
  EXPECT_TRUE(mentions(e, "does not depend on its user (node 2)"));
  e = check(text + "release @0 after %y %z\n");
  EXPECT_TRUE(e.empty()) << e[0];
}

TEST(IrVerifier, GradientReducedTwiceOrNever) {
  const char* grads = "%x = input bytes=4\n%dw = compute \"g\" %x bytes=64 grad=@0\n"
                      "%db = compute \"g\" %x bytes=8 grad=@1\n";
  const auto before_waits = VerifyOptions::complete().waive(Rule::ReductionsWaited);
  auto e = check(std::string(grads) + "%r = reduce_scatter @0 %dw\n%q = reduce_scatter @0 %dw\n",
                 before_waits);
  EXPECT_TRUE(mentions(e, "@0 is reduced 2 times"));
  EXPECT_TRUE(mentions(e, "@1 is reduced 0 times"));
  e = check(std::string(grads) + "%r = reduce_scatter @0 @1 %dw %db\n", before_waits);
  EXPECT_TRUE(e.empty()) << e[0];
  e = check(std::string(grads) + "%r = reduce_scatter @1 @0 %dw %db\n", before_waits);
  EXPECT_TRUE(mentions(e, "is not a gradient of @1"));
  e = check(std::string(grads) + "reduce_scatter @0 @1 %dw %db\n", before_waits);
  EXPECT_TRUE(mentions(e, "must define exactly one value, the token its wait_reduce waits on"));
}

// What a reduction's wait looks like when the rules hold: one wait_reduce
// per reduce_scatter, after it, its shard gradients read by the output.
const char* kReduced = "%x = input bytes=4\n%dw = compute \"g\" %x bytes=64 grad=@0\n"
                       "%db = compute \"g\" %x bytes=8 grad=@1\n"
                       "%r = reduce_scatter @0 @1 %dw %db\n";

TEST(IrVerifier, ReductionsWaited) {
  auto e = check(std::string(kReduced) + "%sw, %sb = wait_reduce %r\noutput %x %sw %sb\n");
  EXPECT_TRUE(e.empty()) << e[0];
}

TEST(IrVerifier, ReductionNeverWaited) {
  const std::string text = std::string(kReduced) + "output %x\n";
  const auto e = check(text);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0], "reduction %r (@0 @1) is never waited on; wait_reduce it before the output");
  EXPECT_TRUE(check(text, VerifyOptions::complete().waive(Rule::ReductionsWaited)).empty());
}

TEST(IrVerifier, ReductionWaitedTwice) {
  const auto e = check(std::string(kReduced) +
                       "%sw, %sb = wait_reduce %r\n%tw, %tb = wait_reduce %r\n"
                       "output %x %sw %sb\n", VerifyOptions::structural());
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0], "node 5 (wait_reduce): waits on %r again; each reduction is waited on once");
}

TEST(IrVerifier, WaitBeforeItsReduction) {
  const auto e = check("%x = input bytes=4\n%dw = compute \"g\" %x bytes=64 grad=@0\n"
                       "%sw = wait_reduce %r\n%r = reduce_scatter @0 %dw\noutput %x %sw\n");
  EXPECT_TRUE(mentions(e, "node 2 (wait_reduce): waits on %r before it is defined; a "
                          "wait_reduce follows its reduce_scatter"));
  EXPECT_TRUE(mentions(e, "reduction %r (@0) is never waited on"));
}

TEST(IrVerifier, WaitWithoutAReduction) {
  auto e = check("%x = input bytes=4\n%s = wait_reduce %x\noutput %x %s\n",
                 VerifyOptions::structural());
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0], "node 1 (wait_reduce): waits on %x, which is not a reduce_scatter's token");
  e = check(std::string(kReduced) + "%sw, %sb = wait_reduce @0 %r\noutput %x %sw %sb\n");
  EXPECT_TRUE(mentions(e, "names parameters; its reduction names them"));
  e = check(std::string(kReduced) + "%sw = wait_reduce %r\noutput %x %sw\n");
  EXPECT_TRUE(mentions(e, "yields 1 values for 2 parameters"));
}

TEST(IrVerifier, ShardGradientsLeaveThroughTheOutput) {
  const auto e = check(std::string(kReduced) + "%sw, %sb = wait_reduce %r\noutput %x %sw\n");
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0], "shard gradient %sb of @1 is not read by the output");
}

TEST(IrVerifier, FullParameterSavedForBackward) {
  const auto e = check("%w = input param=@0\n%y = compute \"a\" %w bytes=4\n");
  EXPECT_TRUE(mentions(e, "saved by forward"));
  const auto before_regather = VerifyOptions::complete().waive(Rule::NoSavedParams);
  EXPECT_TRUE(check("%w = input param=@0\n", before_regather).empty());
}

TEST(IrVerifier, DirectReadsOnlyBeforeInsertion) {
  const char* body = "%x = input bytes=4\n%y = compute \"mm\" %x @0 bytes=4\n";
  EXPECT_TRUE(mentions(check(body), "reads parameter @0 directly"));
  const auto before_insertion = VerifyOptions::complete().waive(Rule::GathersInserted);
  EXPECT_TRUE(check(body, before_insertion).empty());
  EXPECT_TRUE(check(body, VerifyOptions::structural()).empty());
}

TEST(IrVerifier, WaitRightAfterItsGatherOnlyWhenDemanded) {
  const char* apart = "%g = gather @0\n%x = input bytes=4\n%w = wait %g\n"
                      "%y = compute \"a\" %x %w bytes=4\nrelease @0 after %y\n";
  const auto demand = VerifyOptions::structural().require(Rule::WaitsFollowGathers);
  EXPECT_TRUE(check(apart, VerifyOptions::structural()).empty());
  EXPECT_TRUE(mentions(check(apart, demand), "waits on %g, which is not the node right before it"));
  EXPECT_TRUE(check("%g = gather @0\n%w = wait %g\n%y = compute \"a\" %w bytes=4\n"
                    "release @0 after %y\n", demand).empty());
}

TEST(IrVerifier, OneGatherServesOneDtype) {
  const char* body = "%g = gather @0 @1 @2\n%w, %b, %v = wait %g\n"
                     "%y = compute \"a\" %w %b %v bytes=4\nrelease @0 @1 @2 after %y\n";
  auto e = verify(parse("param @0 \"w\" bytes=64 dtype=float32\n"
                        "param @1 \"b\" bytes=8 dtype=bfloat16\n"
                        "param @2 \"v\" bytes=8\n" + std::string(body)),
                  VerifyOptions::structural());
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0], "node 0 (gather): %g serves parameters of different dtypes (@0 float32, "
                  "@1 bfloat16, @2 unknown); one gather is one collective of one dtype");
  e = verify(parse("param @0 \"w\" bytes=64 dtype=bfloat16\n"
                   "param @1 \"b\" bytes=8 dtype=bfloat16\n"
                   "param @2 \"v\" bytes=8 dtype=bfloat16\n" + std::string(body)),
             VerifyOptions::structural());
  EXPECT_TRUE(e.empty()) << e[0];
  e = check("param @2 \"v\" bytes=8\n" + std::string(body), VerifyOptions::structural());
  EXPECT_TRUE(e.empty()) << e[0];  // all unknown: one (unknown) dtype
}

TEST(IrVerifier, RulesHaveNames) {
  EXPECT_STREQ(to_string(Rule::GathersInserted), "gathers inserted");
  EXPECT_STREQ(to_string(Rule::NoSavedParams), "no saved full parameters");
  EXPECT_STREQ(to_string(Rule::WaitsFollowGathers), "each wait right after its gather");
  EXPECT_STREQ(to_string(Rule::GradientsReduced), "gradients reduced");
  EXPECT_STREQ(to_string(Rule::ReductionsWaited), "reductions waited");
}

TEST(IrVerifier, DefinitionsAndDoubleGather) {
  auto e = check("%y = compute \"a\" %nope bytes=4\n");
  EXPECT_TRUE(mentions(e, "before it is defined"));
  e = check("%x = input bytes=4\n%x = input bytes=4\n");
  EXPECT_TRUE(mentions(e, "defined twice"));
  e = check("%g = gather @0\n%h = gather @0\n");
  EXPECT_TRUE(mentions(e, "again before releasing"));
  e = check("release @1\n");
  EXPECT_TRUE(mentions(e, "not gathered"));
}

TEST(IrVerifier, SymbolicSizesReadDeclaredSymbolsAndMatchTheirHints) {
  const char* body =
      "size s0 hint=16\n"
      "size u0\n"
      "%x = input bytes=64 sym=\"4*s0\"\n"
      "%y = compute \"relu\" %x bytes=64 sym=\"4*s0\"\n"
      "%k = compute \"nonzero\" %y bytes=0 sym=\"8*u0\"\n"
      "output %y %k\n";
  EXPECT_TRUE(check(body, VerifyOptions::structural()).empty());
  EXPECT_TRUE(mentions(check("%x = input bytes=64 sym=\"4*s1\"\noutput %x\n",
                             VerifyOptions::structural()),
                       "reads s1, which no line 'size s1 [hint=N]' declares"));
  EXPECT_TRUE(mentions(check("size s0 hint=16\n%x = input bytes=60 sym=\"4*s0\"\noutput %x\n",
                             VerifyOptions::structural()),
                       "bytes=60 but its size \"4*s0\" is 64 at the size hints"));
  EXPECT_TRUE(mentions(check("size s0 hint=0\n%x = input bytes=0 sym=\"4//s0\"\noutput %x\n",
                             VerifyOptions::structural()),
                       "division by zero"));
}

TEST(IrVerifier, GradientsHaveStaticSizes) {
  const auto e = check(
      "size s0 hint=16\n"
      "%x = input bytes=64 sym=\"4*s0\"\n"
      "%dw = compute \"mm\" %x bytes=64 sym=\"4*s0\" grad=@0\n"
      "output %dw\n",
      VerifyOptions::structural());
  EXPECT_TRUE(mentions(e, "the gradient of @0 has a symbolic size")) << (e.empty() ? "" : e[0]);
}

}  // namespace
}  // namespace sharc::ir
