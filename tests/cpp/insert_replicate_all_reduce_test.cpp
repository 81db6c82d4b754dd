#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

// Two buckets, as place_reduce_waits leaves them.
const char* kWaited = R"(
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
)";

VerifyOptions hybrid() { return VerifyOptions::complete().require(Rule::ReplicasReduced); }

TEST(InsertReplicateAllReduce, EachAllReduceWhereItsWaitWasTheWaitAfterTheNextAllReduce) {
  auto pass = make_insert_replicate_all_reduce(2);
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, kWaited, &rewrites);
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
%sharc_reduce_0_replicas = all_reduce %sharc_reduce_0
%u = compute "u" %t bytes=16
%sharc_reduce_2_replicas = all_reduce %sharc_reduce_2
%sharc_shard_grad_0, %sharc_shard_grad_1 = wait_reduce %sharc_reduce_0_replicas
%sharc_shard_grad_2 = wait_reduce %sharc_reduce_2_replicas
output %u %sharc_shard_grad_0 %sharc_shard_grad_1 %sharc_shard_grad_2
)"));
  EXPECT_EQ(rewrites, 2);
  EXPECT_TRUE(verify(parse(out), hybrid()).empty());
  int64_t again = -1;
  EXPECT_EQ(run_pass(*pass, out, &again), out);  // runs twice, inserts once
  EXPECT_EQ(again, 0);
}

TEST(InsertReplicateAllReduce, FlatShardingIsLeftAlone) {
  auto pass = make_insert_replicate_all_reduce(1);
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, kWaited, &rewrites), canonical(kWaited));
  EXPECT_EQ(rewrites, 0);
}

TEST(InsertReplicateAllReduce, TheVerifierDemandsAnAllReduceBeforeEachWait) {
  // Flat: fine. Hybrid: every wait on a token no all_reduce took over fails.
  EXPECT_TRUE(verify(parse(kWaited)).empty());
  const auto errors = verify(parse(kWaited), hybrid());
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("before any all_reduce of it"), std::string::npos) << errors[0];
}

TEST(InsertReplicateAllReduce, TheVerifierRejectsMisplacedAllReduces) {
  auto errors_of = [](const std::string& tail) {
    return verify(parse(std::string(R"(
param @0 "a" bytes=40
%dy = input bytes=16
%da = compute "g" %dy bytes=40 grad=@0
%r = reduce_scatter @0 %da
)") + tail), hybrid());
  };
  auto has = [](const std::vector<std::string>& errors, const std::string& text) {
    for (const std::string& e : errors) {
      if (e.find(text) != std::string::npos) return true;
    }
    return false;
  };
  EXPECT_TRUE(errors_of("%a = all_reduce %r\n%s = wait_reduce %a\noutput %s\n").empty());
  EXPECT_TRUE(has(errors_of("%a = all_reduce %r\n%b = all_reduce %r\n%s = wait_reduce %a\n"
                            "output %s\n"), "all-reduces %r again"));
  EXPECT_TRUE(has(errors_of("%a = all_reduce %r\n%b = all_reduce %a\n%s = wait_reduce %b\n"
                            "output %s\n"), "all-reduces %a again"));
  EXPECT_TRUE(has(errors_of("%s = wait_reduce %r\n%a = all_reduce %r\noutput %s\n"),
                  "after its wait_reduce"));
  EXPECT_TRUE(has(errors_of("%a = all_reduce %r\n%s = wait_reduce %r\noutput %s\n"),
                  "which an all_reduce took over"));
  EXPECT_TRUE(has(errors_of("%a = all_reduce %dy\n%s = wait_reduce %r\noutput %s\n"),
                  "not a reduce_scatter's token"));
  EXPECT_TRUE(has(errors_of("%a = all_reduce %r\noutput %dy\n"), "never waited on"));
}

TEST(InsertReplicateAllReduce, TheShippingPipelineAllReducesOnlyWithReplicas) {
  const Graph bridge = parse(R"(
param @0 "w" bytes=64
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
%dw = compute "g" %y bytes=64 grad=@0
output %y
)");
  PipelineOptions flat;
  Graph g = bridge;
  make_pipeline(flat).run(g);
  EXPECT_EQ(print(g).find("all_reduce"), std::string::npos);

  PipelineOptions options;
  options.replicas = 2;
  g = bridge;
  make_pipeline(options).run(g);
  EXPECT_NE(print(g).find("all_reduce"), std::string::npos) << print(g);
  EXPECT_TRUE(verify(g, hybrid()).empty());

  // Switching the pass off leaves a schedule the final rules refuse.
  options.disabled_passes = {"insert_replicate_all_reduce"};
  g = bridge;
  EXPECT_THROW(make_pipeline(options).run(g), Error);
}

}  // namespace
}  // namespace sharc::ir
