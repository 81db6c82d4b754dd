#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::expect_nothing_to_do;
using testing::run_pass;

TEST(MarkGraphPrefetch, AfterTheLastWaitAndTheLastRelease) {
  int64_t rewrites = -1;
  const std::string out = run_pass(*make_mark_graph_prefetch(4096), R"(
param @0 "w0" bytes=64
param @1 "w1" bytes=64
%x = input bytes=16
%g0 = gather @0
%w0 = wait %g0
%g1 = gather @1
%y0 = compute "mm" %x %w0 bytes=16
release @0 after %y0
%w1 = wait %g1
%y1 = compute "mm" %y0 %w1 bytes=16
%z = compute "relu" %y1 bytes=16
release @1 after %z
%o = compute "sum" %z bytes=4
output %o
)", &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w0" bytes=64
param @1 "w1" bytes=64
%x = input bytes=16
%g0 = gather @0
%w0 = wait %g0
%g1 = gather @1
%y0 = compute "mm" %x %w0 bytes=16
release @0 after %y0
%w1 = wait %g1
prefetch_next @1 after %y0 bytes=4096
%y1 = compute "mm" %y0 %w1 bytes=16
%z = compute "relu" %y1 bytes=16
release @1 after %z
prefetch_next @1 after %z bytes=4096
%o = compute "sum" %z bytes=4
output %o
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::complete()
                                     .waive(Rule::GradientsReduced)
                                     .waive(Rule::ReductionsWaited))
                  .empty());
  // Marked once: running again changes nothing.
  EXPECT_EQ(run_pass(*make_mark_graph_prefetch(4096), out, &rewrites), out);
  EXPECT_EQ(rewrites, 0);
}

TEST(MarkGraphPrefetch, WithoutABudgetTheMarkSaysNone) {
  const std::string out = run_pass(*make_mark_graph_prefetch(), R"(
param @0 "w" bytes=64
%g = gather @0
%w = wait %g
%y = compute "neg" %w bytes=64
release @0 after %y
output %y
)");
  EXPECT_NE(out.find("prefetch_next @0 bytes=-1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("prefetch_next @0 after %y bytes=-1\n"), std::string::npos) << out;
}

TEST(MarkGraphPrefetch, AMarkReadingAFullParameterIsAUseTheVerifierChecks) {
  // Why the mark is ordered after a compute value, never the gathered one.
  const char* in = R"(
param @0 "w" bytes=64
%g = gather @0
%w = wait %g
%y = compute "neg" %w bytes=64
release @0 after %y
prefetch_next @0 after %w
output %y
)";
  EXPECT_FALSE(verify(parse(in), VerifyOptions::structural()).empty());
}

TEST(MarkGraphPrefetch, Contract) {
  const Contract c = make_mark_graph_prefetch()->contract();
  EXPECT_EQ(c.required, (std::vector<Rule>{Rule::GathersInserted}));
  EXPECT_TRUE(c.established.empty());
  EXPECT_TRUE(c.undone.empty());
}

TEST(MarkGraphPrefetch, NothingToDo) {
  auto pass = make_mark_graph_prefetch(64);
  expect_nothing_to_do(*pass);
}

}  // namespace
}  // namespace sharc::ir
