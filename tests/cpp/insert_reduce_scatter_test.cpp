#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

const char* kBackward = R"(
param @0 "a" bytes=40
param @1 "b" bytes=40
param @2 "c" bytes=200
%dy = input bytes=16
%da = compute "g" %dy bytes=40 grad=@0
%t = compute "t" %dy bytes=16
%db = compute "g" %t bytes=40 grad=@1
%dc = compute "g" %t bytes=200 grad=@2
output %t
)";

// The reductions are in, not yet waited on (place_reduce_waits' job).
const VerifyOptions kBeforeWaits = VerifyOptions::complete().waive(Rule::ReductionsWaited);

TEST(InsertReduceScatter, BucketsSmallGradientsAndPlacesAfterLastProducer) {
  auto pass = make_insert_reduce_scatter(/*bucket_bytes=*/100);
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, kBackward, &rewrites);
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
output %t
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out), kBeforeWaits).empty());
}

TEST(InsertReduceScatter, TinyBucketsReduceEachGradientAlone) {
  auto pass = make_insert_reduce_scatter(1);
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, kBackward, &rewrites);
  EXPECT_EQ(rewrites, 3);
  EXPECT_NE(out.find("%da = compute \"g\" %dy bytes=40 grad=@0\n"
                     "%sharc_reduce_0 = reduce_scatter @0 %da\n"),
            std::string::npos) << out;
  EXPECT_TRUE(verify(parse(out), kBeforeWaits).empty());
  const auto unwaited = verify(parse(out));
  ASSERT_EQ(unwaited.size(), 3u);
  EXPECT_EQ(unwaited[0], "reduction %sharc_reduce_0 (@0) is never waited on; wait_reduce it "
                         "before the output");
}

TEST(InsertReduceScatter, Contract) {
  const Contract c = make_insert_reduce_scatter(100)->contract();
  EXPECT_TRUE(c.required.empty());
  EXPECT_EQ(c.established, (std::vector<Rule>{Rule::GradientsReduced}));
  EXPECT_TRUE(c.undone.empty());
}

TEST(InsertReduceScatter, NoGradientsNothingToDo) {
  testing::expect_nothing_to_do(*make_insert_reduce_scatter(100));
}

}  // namespace
}  // namespace sharc::ir
