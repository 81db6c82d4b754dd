#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

TEST(InsertGatherRelease, GatherBeforeFirstUseReleaseAfterLastUse) {
  auto pass = make_insert_gather_release();
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
%z = compute "add" %y @1 bytes=16
%u = compute "mm" %z @0 bytes=16
output %u
)", &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
%x = input bytes=16
%sharc_gather_0 = gather @0
%sharc_full_0 = wait %sharc_gather_0
%y = compute "mm" %x %sharc_full_0 bytes=16
%sharc_gather_1 = gather @1
%sharc_full_1 = wait %sharc_gather_1
%z = compute "add" %y %sharc_full_1 bytes=16
release @1 after %z
%u = compute "mm" %z %sharc_full_0 bytes=16
release @0 after %u
output %u
)"));
  EXPECT_EQ(rewrites, 2);
  // A parameter used twice is released once, after the second use (which
  // reads the first use's output, so depending on it covers both).
  EXPECT_TRUE(verify(parse(out), VerifyOptions::complete().waive(Rule::GradientsReduced)).empty());
}

TEST(InsertGatherRelease, TwoReadsInOneNode) {
  auto pass = make_insert_gather_release();
  const std::string out = run_pass(*pass, R"(
param @0 "w" bytes=64
%y = compute "gram" @0 @0 bytes=64
output %y
)");
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64
%sharc_gather_0 = gather @0
%sharc_full_0 = wait %sharc_gather_0
%y = compute "gram" %sharc_full_0 %sharc_full_0 bytes=64
release @0 after %y
output %y
)"));
}

// x * w[0] + w[1:].sum(): the first use feeds no later use, so the release
// must depend on it as well as on the last one, or a compiler that fuses the
// first use into the final add would read the buffer after it is freed.
TEST(InsertGatherRelease, ReleaseDependsOnEveryUseNoLaterUseReads) {
  auto pass = make_insert_gather_release();
  const std::string out = run_pass(*pass, R"(
param @0 "w" bytes=12
%x = input bytes=16
%a = compute "mul" %x @0 bytes=16
%s = compute "sum" @0 bytes=4
%c = compute "mul" %s @0 bytes=4
%y = compute "add" %a %c bytes=16
output %y
)");
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=12
%x = input bytes=16
%sharc_gather_0 = gather @0
%sharc_full_0 = wait %sharc_gather_0
%a = compute "mul" %x %sharc_full_0 bytes=16
%s = compute "sum" %sharc_full_0 bytes=4
%c = compute "mul" %s %sharc_full_0 bytes=4
release @0 after %a %c
%y = compute "add" %a %c bytes=16
output %y
)"));
  EXPECT_TRUE(verify(parse(out), VerifyOptions::complete().waive(Rule::GradientsReduced)).empty());
}

TEST(InsertGatherRelease, ContractAndItsOutputKeepsIt) {
  auto pass = make_insert_gather_release();
  const Contract c = pass->contract();
  EXPECT_TRUE(c.required.empty());
  EXPECT_EQ(c.established, (std::vector<Rule>{Rule::GathersInserted, Rule::WaitsFollowGathers}));
  EXPECT_TRUE(c.undone.empty());
  const std::string out = run_pass(*pass, R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
%x = input bytes=16
%y = compute "mm" %x @0 @1 bytes=16
%z = compute "add" %y @1 bytes=16
output %z
)");
  const auto rules = VerifyOptions::structural()
                         .require(Rule::GathersInserted)
                         .require(Rule::WaitsFollowGathers);
  EXPECT_TRUE(verify(parse(out), rules).empty()) << out;
}

TEST(InsertGatherRelease, NothingToDo) {
  testing::expect_nothing_to_do(*make_insert_gather_release());
}

}  // namespace
}  // namespace sharc::ir
