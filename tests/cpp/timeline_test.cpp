#include <gtest/gtest.h>

#include "sharc/compiler/timeline.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

// 1 µs per byte, no latency: a collective of B bytes takes B µs.
const CollectiveCostModel kOneUsPerByte{CollectiveCost{0.0, 1.0}, CollectiveCost{0.0, 1.0}};

TEST(Timeline, ComputeRunsBackToBackAndAGatherOverlapsIt) {
  const Graph g = parse(R"(
param @0 "w" bytes=10
%x = input bytes=4
%g = gather @0
%a = compute "mm" %x bytes=4 cost=6
%w = wait %g
%y = compute "mm" %a %w bytes=4 cost=3
release @0 after %y
output %y
)");
  const Timeline t = predict(g, kOneUsPerByte);
  // The gather takes 10 µs; 6 of compute hide 6, the wait holds 4.
  EXPECT_DOUBLE_EQ(t.done_us[1], 10.0);
  EXPECT_DOUBLE_EQ(t.start_us[3], 6.0);  // the wait is reached at 6
  EXPECT_DOUBLE_EQ(t.start_us[4], 10.0); // and released at 10
  EXPECT_DOUBLE_EQ(t.exposed_us, 4.0);
  EXPECT_DOUBLE_EQ(t.end_us, 13.0);
}

TEST(Timeline, CollectivesShareOneChannelInIssueOrder) {
  const Graph g = parse(R"(
param @0 "a" bytes=5
param @1 "b" bytes=5
%g0 = gather @0
%g1 = gather @1
%w0 = wait %g0
%w1 = wait %g1
%y = compute "add" %w0 %w1 bytes=4 cost=1
release @0 @1 after %y
output %y
)");
  const Timeline t = predict(g, kOneUsPerByte);
  EXPECT_DOUBLE_EQ(t.done_us[0], 5.0);
  EXPECT_DOUBLE_EQ(t.done_us[1], 10.0);  // queued behind the first
  EXPECT_DOUBLE_EQ(t.exposed_us, 10.0);
  EXPECT_DOUBLE_EQ(t.end_us, 11.0);
}

TEST(Timeline, KeptParametersAndUnmeasuredCostsTakeNoTime) {
  const Graph g = parse(R"(
param @0 "w" bytes=10 kept
%g = gather @0
%w = wait %g
%y = compute "mm" %w bytes=4
release @0 after %y
output %y
)");
  const Timeline t = predict(g, kOneUsPerByte);
  EXPECT_DOUBLE_EQ(t.end_us, 0.0);
  EXPECT_FALSE(has_compute_costs(g));
  EXPECT_DOUBLE_EQ(predict(g, {}).end_us, 0.0);
}

TEST(Timeline, AReductionCostsItsGradientsBytes) {
  const Graph g = parse(R"(
param @0 "w" bytes=8
%x = input bytes=4
%dw = compute "mm" %x bytes=8 grad=@0 cost=2
%r = reduce_scatter @0 %dw
%d = compute "relu" %x bytes=4 cost=3
%s = wait_reduce %r
output %d %s
)");
  const Timeline t = predict(g, kOneUsPerByte);
  EXPECT_DOUBLE_EQ(t.done_us[2], 10.0);  // issued at 2, 8 µs
  EXPECT_DOUBLE_EQ(t.exposed_us, 5.0);   // reached at 5
  EXPECT_TRUE(has_compute_costs(g));
}

TEST(Timeline, AWaitOnNothingIssuedIsAnError) {
  Graph g = parse("%x = input bytes=4\noutput %x\n");
  Node wait;
  wait.kind = NodeKind::Wait;
  wait.operands = {Operand::of_value("nothing")};
  wait.outputs = {"w"};
  g.nodes.insert(g.nodes.begin() + 1, wait);
  EXPECT_THROW(predict(g, kOneUsPerByte), Error);
}

}  // namespace
}  // namespace sharc::ir
