#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

const char* kThreeGathers = R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
param @2 "v" bytes=64
%x = input bytes=16
%g0 = gather @0
%w = wait %g0
%g1 = gather @1
%b = wait %g1
%g2 = gather @2
%v = wait %g2
%y = compute "addmm" %b %x %w %v bytes=16
release @0 @1 @2 after %y
output %y
)";

TEST(BucketAllGathers, FusesAdjacentGathersUpToTheBucketSize) {
  auto pass = make_bucket_allgathers(/*bucket_bytes=*/72);
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, kThreeGathers, &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
param @2 "v" bytes=64
%x = input bytes=16
%g0 = gather @0 @1
%w, %b = wait %g0
%g2 = gather @2
%v = wait %g2
%y = compute "addmm" %b %x %w %v bytes=16
release @0 @1 @2 after %y
output %y
)"));
  EXPECT_EQ(rewrites, 1);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::structural()).empty());
}

TEST(BucketAllGathers, LargeBucketTakesAll) {
  auto pass = make_bucket_allgathers(1 << 20);
  const std::string out = run_pass(*pass, kThreeGathers);
  EXPECT_NE(out.find("%g0 = gather @0 @1 @2\n%w, %b, %v = wait %g0\n"), std::string::npos)
      << out;
}

const char* kGathersApart = R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
%g0 = gather @0
%w = wait %g0
%y = compute "relu" %w bytes=64
%g1 = gather @1
%b = wait %g1
%z = compute "add" %y %b bytes=64
release @0 after %y
release @1 after %z
output %z
)";

TEST(BucketAllGathers, LaterGatherMovesUpIntoTheOpenBucket) {
  auto pass = make_bucket_allgathers(1 << 20);
  int64_t rewrites = -1;
  const std::string out = run_pass(*pass, kGathersApart, &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64
param @1 "b" bytes=8
%g0 = gather @0 @1
%w, %b = wait %g0
%y = compute "relu" %w bytes=64
%z = compute "add" %y %b bytes=64
release @0 after %y
release @1 after %z
output %z
)"));
  EXPECT_EQ(rewrites, 1);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::structural()).empty());
}

TEST(BucketAllGathers, GatherThatDoesNotFitOpensTheNextBucket) {
  auto pass = make_bucket_allgathers(/*bucket_bytes=*/70);
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, kGathersApart, &rewrites), canonical(kGathersApart));
  EXPECT_EQ(rewrites, 0);
}

TEST(BucketAllGathers, ParameterGatheredAgainAfterReleaseIsNotHoisted) {
  auto pass = make_bucket_allgathers(1 << 20);
  const char* in = R"(
param @0 "w" bytes=64
%g0 = gather @0
%w = wait %g0
%y = compute "relu" %w bytes=64
release @0 after %y
%g1 = gather @0
%w1 = wait %g1
%z = compute "add" %y %w1 bytes=64
release @0 after %z
output %z
)";
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, in, &rewrites), canonical(in));
  EXPECT_EQ(rewrites, 0);
}

TEST(BucketAllGathers, RequiresAndKeepsWaitsRightAfterTheirGathers) {
  auto pass = make_bucket_allgathers(1 << 20);
  const Contract c = pass->contract();
  EXPECT_EQ(c.required, (std::vector<Rule>{Rule::WaitsFollowGathers}));
  EXPECT_TRUE(c.established.empty());
  EXPECT_TRUE(c.undone.empty());
  const std::string out = run_pass(*pass, kGathersApart);
  const auto rules = VerifyOptions::structural().require(Rule::WaitsFollowGathers);
  EXPECT_TRUE(verify(parse(out), rules).empty()) << out;
}

// One bucket is one collective of one dtype: each dtype has its bucket
// open, and a gather joins the one of its dtype, across gathers of others
// (autocast alternates fp32 norms and bf16 linears within a block).
const char* kMixedDtypes = R"(
param @0 "w" bytes=64 dtype=bfloat16
param @1 "b" bytes=8 dtype=float32
param @2 "v" bytes=64 dtype=float32
param @3 "u" bytes=64 dtype=bfloat16
param @4 "t" bytes=64
%x = input bytes=16
%g0 = gather @0
%w = wait %g0
%g1 = gather @1
%b = wait %g1
%g2 = gather @2
%v = wait %g2
%g3 = gather @3
%u = wait %g3
%g4 = gather @4
%t = wait %g4
%y = compute "addmm" %b %x %w %v %u %t bytes=16
release @0 @1 @2 @3 @4 after %y
output %y
)";

TEST(BucketAllGathers, EachDtypeFillsItsOwnBucket) {
  auto pass = make_bucket_allgathers(1 << 20);
  int64_t rewrites = -1;
  const std::string out = run_pass(*pass, kMixedDtypes, &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64 dtype=bfloat16
param @1 "b" bytes=8 dtype=float32
param @2 "v" bytes=64 dtype=float32
param @3 "u" bytes=64 dtype=bfloat16
param @4 "t" bytes=64
%x = input bytes=16
%g0 = gather @0 @3
%w, %u = wait %g0
%g1 = gather @1 @2
%b, %v = wait %g1
%g4 = gather @4
%t = wait %g4
%y = compute "addmm" %b %x %w %v %u %t bytes=16
release @0 @1 @2 @3 @4 after %y
output %y
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out), VerifyOptions::structural()).empty());
}

// A full bucket of one dtype closes that dtype's bucket only: the next
// gather of that dtype opens a new one, and the other dtype's stays open.
TEST(BucketAllGathers, AFullBucketLeavesTheOtherDtypesOpen) {
  auto pass = make_bucket_allgathers(/*bucket_bytes=*/100);
  const std::string out = run_pass(*pass, kMixedDtypes);
  EXPECT_NE(out.find("%g0 = gather @0\n%w = wait %g0\n%g1 = gather @1 @2\n%b, %v = wait %g1\n"
                     "%g3 = gather @3\n%u = wait %g3\n"),
            std::string::npos)
      << out;
}

TEST(BucketAllGathers, ZeroBucketFusesNothing) {
  auto pass = make_bucket_allgathers(0);
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, kThreeGathers, &rewrites), canonical(kThreeGathers));
  EXPECT_EQ(rewrites, 0);
}

}  // namespace
}  // namespace sharc::ir
