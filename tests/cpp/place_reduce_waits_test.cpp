#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

// Two buckets, as insert_reduce_scatter leaves them: started, not waited on.
const char* kTwoBuckets = R"(
param @0 "a" bytes=40
param @1 "b" bytes=40
param @2 "c" bytes=200
%dy = input bytes=16
%da = compute "g" %dy bytes=40 grad=@0
%t = compute "t" %dy bytes=16
%db = compute "g" %t bytes=40 grad=@1
%sharc_reduce_0 = reduce_scatter @0 @1 %da %db
%dc = compute "g" %t bytes=200 grad=@2
%sharc_reduce_2 = reduce_scatter @2 %dc
%u = compute "u" %t bytes=16
output %u
)";

TEST(PlaceReduceWaits, EachWaitRightAfterTheNextReductionStartsTheLastBeforeTheOutput) {
  auto pass = make_place_reduce_waits();
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, kTwoBuckets, &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "a" bytes=40
param @1 "b" bytes=40
param @2 "c" bytes=200
%dy = input bytes=16
%da = compute "g" %dy bytes=40 grad=@0
%t = compute "t" %dy bytes=16
%db = compute "g" %t bytes=40 grad=@1
%sharc_reduce_0 = reduce_scatter @0 @1 %da %db
%dc = compute "g" %t bytes=200 grad=@2
%sharc_reduce_2 = reduce_scatter @2 %dc
%sharc_shard_grad_0, %sharc_shard_grad_1 = wait_reduce %sharc_reduce_0
%u = compute "u" %t bytes=16
%sharc_shard_grad_2 = wait_reduce %sharc_reduce_2
output %u %sharc_shard_grad_0 %sharc_shard_grad_1 %sharc_shard_grad_2
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out)).empty());
}

TEST(PlaceReduceWaits, ASingleBucketIsWaitedOnRightBeforeTheOutput) {
  auto pass = make_place_reduce_waits();
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, R"(
param @0 "w" bytes=64
%dy = input bytes=16
%dw = compute "g" %dy bytes=64 grad=@0
%sharc_reduce_0 = reduce_scatter @0 %dw
%dx = compute "mm" %dy bytes=16
output %dx
)", &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=64
%dy = input bytes=16
%dw = compute "g" %dy bytes=64 grad=@0
%sharc_reduce_0 = reduce_scatter @0 %dw
%dx = compute "mm" %dy bytes=16
%sharc_shard_grad_0 = wait_reduce %sharc_reduce_0
output %dx %sharc_shard_grad_0
)"));
  EXPECT_EQ(rewrites, 1);
  EXPECT_TRUE(verify(parse(out)).empty());
}

TEST(PlaceReduceWaits, ReductionsWaitedOnAlreadyAreLeftAlone) {
  auto pass = make_place_reduce_waits();
  const std::string once = run_pass(*pass, kTwoBuckets);
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, once, &rewrites), once);
  EXPECT_EQ(rewrites, 0);
}

TEST(PlaceReduceWaits, Contract) {
  const Contract c = make_place_reduce_waits()->contract();
  EXPECT_EQ(c.required, (std::vector<Rule>{Rule::GradientsReduced}));
  EXPECT_EQ(c.established, (std::vector<Rule>{Rule::ReductionsWaited}));
  EXPECT_TRUE(c.undone.empty());
  EXPECT_TRUE(c.precedes.empty());
}

TEST(PlaceReduceWaits, NoGradientsNothingToDo) {
  testing::expect_nothing_to_do(*make_place_reduce_waits());
}

}  // namespace
}  // namespace sharc::ir
