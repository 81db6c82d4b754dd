#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::expect_nothing_to_do;
using testing::run_pass;

TEST(PrefetchGathers, NextGatherStartsRightAfterThePreviousWait) {
  auto pass = make_prefetch_gathers();
  int64_t rewrites = -1;
  const std::string out = run_pass(*pass, R"(
param @0 "w0" bytes=64
param @1 "w1" bytes=64
param @2 "w2" bytes=64
%x = input bytes=16
%g0 = gather @0
%w0 = wait %g0
%y0 = compute "mm" %x %w0 bytes=16
release @0 after %y0
%g1 = gather @1
%w1 = wait %g1
%y1 = compute "mm" %y0 %w1 bytes=16
release @1 after %y1
%g2 = gather @2
%w2 = wait %g2
%y2 = compute "mm" %y1 %w2 bytes=16
release @2 after %y2
output %y2
)", &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w0" bytes=64
param @1 "w1" bytes=64
param @2 "w2" bytes=64
%x = input bytes=16
%g0 = gather @0
%w0 = wait %g0
%g1 = gather @1
%y0 = compute "mm" %x %w0 bytes=16
release @0 after %y0
%w1 = wait %g1
%g2 = gather @2
%y1 = compute "mm" %y0 %w1 bytes=16
release @1 after %y1
%w2 = wait %g2
%y2 = compute "mm" %y1 %w2 bytes=16
release @2 after %y2
output %y2
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::structural()).empty());
}

TEST(PrefetchGathers, ParameterIsNotGatheredAgainBeforeItsRelease) {
  auto pass = make_prefetch_gathers();
  const char* in = R"(
param @0 "w" bytes=64
%x = input bytes=16
%g0 = gather @0
%w0 = wait %g0
%y = compute "mm" %x %w0 bytes=16
release @0 after %y
%g1 = gather @0
%w1 = wait %g1
%z = compute "mm" %y %w1 bytes=16
release @0 after %z
output %z
)";
  int64_t rewrites = -1;
  const std::string out = run_pass(*pass, in, &rewrites);
  EXPECT_EQ(out, canonical(in));
  EXPECT_EQ(rewrites, 0);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::structural()).empty());
}

TEST(PrefetchGathers, Contract) {
  const Contract c = make_prefetch_gathers()->contract();
  EXPECT_EQ(c.required, (std::vector<Rule>{Rule::GathersInserted}));
  EXPECT_TRUE(c.established.empty());
  EXPECT_EQ(c.undone, (std::vector<Rule>{Rule::WaitsFollowGathers}));
}

TEST(PrefetchGathers, NothingToDo) {
  auto pass = make_prefetch_gathers();
  expect_nothing_to_do(*pass);
}

}  // namespace
}  // namespace sharc::ir
