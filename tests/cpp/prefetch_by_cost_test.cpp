#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/compiler/timeline.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::expect_nothing_to_do;
using testing::run_pass;

const CollectiveCostModel kOneUsPerByte{CollectiveCost{0.0, 1.0}, CollectiveCost{0.0, 1.0}};

// Three layers as prefetch_gathers leaves them; @1's gather takes 10 µs,
// but only 4 µs of compute precede its wait.
const char* kThreeLayers = R"(
param @0 "w0" bytes=2
param @1 "w1" bytes=10
param @2 "w2" bytes=2
%x = input bytes=4
%g0 = gather @0
%w0 = wait %g0
%a = compute "relu" %x bytes=4 cost=8
%y0 = compute "mm" %a %w0 bytes=4 cost=4
release @0 after %y0
%g1 = gather @1
%w1 = wait %g1
%y1 = compute "mm" %y0 %w1 bytes=4 cost=4
release @1 after %y1
%g2 = gather @2
%w2 = wait %g2
%y2 = compute "mm" %y1 %w2 bytes=4 cost=4
release @2 after %y2
output %y2
)";

TEST(PrefetchByCost, AGatherMovesAsEarlyAsItsCollectiveNeeds) {
  auto pass = make_prefetch_by_cost(kOneUsPerByte);
  int64_t rewrites = -1;
  const std::string out = run_pass(*pass, kThreeLayers, &rewrites);
  // @1 needs 10 µs before its wait, reached at 14: issued by 4, so right
  // after @0's wait (at 2), before the 8 µs relu; no higher, since @0's
  // gather is a collective. @2 needs 2 µs and its wait is reached at 18
  // with the channel free from 12: issued by 16, before the 4 µs mm.
  EXPECT_EQ(out, canonical(R"(
param @0 "w0" bytes=2
param @1 "w1" bytes=10
param @2 "w2" bytes=2
%x = input bytes=4
%g0 = gather @0
%w0 = wait %g0
%g1 = gather @1
%a = compute "relu" %x bytes=4 cost=8
%y0 = compute "mm" %a %w0 bytes=4 cost=4
release @0 after %y0
%w1 = wait %g1
%g2 = gather @2
%y1 = compute "mm" %y0 %w1 bytes=4 cost=4
release @1 after %y1
%w2 = wait %g2
%y2 = compute "mm" %y1 %w2 bytes=4 cost=4
release @2 after %y2
output %y2
)"));
  EXPECT_EQ(rewrites, 2);
  const Graph before = parse(kThreeLayers), after = parse(out);
  EXPECT_LT(predict(after, kOneUsPerByte).exposed_us, predict(before, kOneUsPerByte).exposed_us);
  EXPECT_TRUE(verify(after, VerifyOptions::structural()).empty());
}

TEST(PrefetchByCost, AGatherIsIssuedNoEarlierThanNeeded) {
  // 10 µs of compute before the wait; a 3 µs gather goes right before the
  // last 3 µs of it, not to the top.
  const char* in = R"(
param @0 "w" bytes=3
%x = input bytes=4
%a = compute "relu" %x bytes=4 cost=4
%b = compute "relu" %a bytes=4 cost=3
%c = compute "relu" %b bytes=4 cost=3
%g = gather @0
%w = wait %g
%y = compute "mm" %c %w bytes=4 cost=1
release @0 after %y
output %y
)";
  const std::string out = run_pass(*make_prefetch_by_cost(kOneUsPerByte), in);
  EXPECT_EQ(out, canonical(R"(
param @0 "w" bytes=3
%x = input bytes=4
%a = compute "relu" %x bytes=4 cost=4
%b = compute "relu" %a bytes=4 cost=3
%g = gather @0
%c = compute "relu" %b bytes=4 cost=3
%w = wait %g
%y = compute "mm" %c %w bytes=4 cost=1
release @0 after %y
output %y
)"));
  EXPECT_DOUBLE_EQ(predict(parse(out), kOneUsPerByte).exposed_us, 0.0);
}

TEST(PrefetchByCost, NeverAboveAReductionOrARelease) {
  // The gather would need 20 µs: it may not pass the reduction (the order
  // of collectives is every rank's) nor the release of its own parameter.
  const char* in = R"(
param @0 "w" bytes=20
param @1 "v" bytes=4
%x = input bytes=4
%g0 = gather @0
%w0 = wait %g0
%y0 = compute "mm" %x %w0 bytes=4 cost=5
release @0 after %y0
%dv = compute "mm" %y0 bytes=4 grad=@1 cost=5
%r = reduce_scatter @1 %dv
%a = compute "relu" %y0 bytes=4 cost=5
%g1 = gather @0
%w1 = wait %g1
%y1 = compute "mm" %a %w1 bytes=4 cost=5
release @0 after %y1
%s = wait_reduce %r
output %y1 %s
)";
  const std::string out = run_pass(*make_prefetch_by_cost(kOneUsPerByte), in);
  const Graph g = parse(out);
  // %g1 goes right after the reduction, above the relu, and no higher.
  EXPECT_EQ(g.nodes[6].kind, NodeKind::ReduceScatter);
  EXPECT_EQ(g.nodes[7].kind, NodeKind::Gather);
  EXPECT_EQ(g.nodes[7].outputs[0], "g1");
}

TEST(PrefetchByCost, StaysWithinTheBudget) {
  // Moving @1 to the top would hold w0 and w1 (12 bytes) at once; a budget
  // of 11 keeps it after @0's release.
  auto pass = make_prefetch_by_cost(kOneUsPerByte, 11);
  const std::string out = run_pass(*pass, kThreeLayers);
  const Graph g = parse(out);
  EXPECT_LE(peak_gathered(g).bytes, 11);
  EXPECT_EQ(out, canonical(kThreeLayers));  // nowhere earlier fits
  auto roomy = make_prefetch_by_cost(kOneUsPerByte, 12);
  EXPECT_NE(run_pass(*roomy, kThreeLayers), canonical(kThreeLayers));
}

TEST(PrefetchByCost, WithoutCostsNothingMoves) {
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*make_prefetch_by_cost({}), kThreeLayers, &rewrites),
            canonical(kThreeLayers));
  EXPECT_EQ(rewrites, 0);
  const char* unmeasured = R"(
param @0 "w" bytes=10
%x = input bytes=4
%a = compute "relu" %x bytes=4
%g = gather @0
%w = wait %g
%y = compute "mm" %a %w bytes=4
release @0 after %y
output %y
)";
  EXPECT_EQ(run_pass(*make_prefetch_by_cost(kOneUsPerByte), unmeasured, &rewrites),
            canonical(unmeasured));
  EXPECT_EQ(rewrites, 0);
}

TEST(PrefetchByCost, Contract) {
  const Contract c = make_prefetch_by_cost({})->contract();
  EXPECT_EQ(c.required, (std::vector<Rule>{Rule::GathersInserted, Rule::GradientsReduced}));
  EXPECT_TRUE(c.established.empty());
  EXPECT_EQ(c.undone, (std::vector<Rule>{Rule::WaitsFollowGathers}));
}

TEST(PrefetchByCost, NothingToDo) {
  auto pass = make_prefetch_by_cost(kOneUsPerByte);
  expect_nothing_to_do(*pass);
}

}  // namespace
}  // namespace sharc::ir

namespace sharc::ir {
namespace {

// Four layers whose weights take 6 µs to gather each, the first layer 12 µs
// of compute and the others 2, as the bridge lowers a forward: the shipping
// pipeline, with measured costs, starts the third gather during the first
// layer (two buckets ahead), within the budget; its schedule verifies and is
// predicted to wait less than one bucket ahead (8 µs against 14).
TEST(PrefetchByCost, InTheShippingPipelineTheScheduleWaitsLess) {
  const char* lowered = R"(
param @0 "w0" bytes=6 dtype=float32
param @1 "w1" bytes=6 dtype=float32
param @2 "w2" bytes=6 dtype=float32
param @3 "w3" bytes=6 dtype=float32
%x = input bytes=4
%y0 = compute "mm" %x @0 bytes=4 cost=12
%y1 = compute "mm" %y0 @1 bytes=4 cost=2
%y2 = compute "mm" %y1 @2 bytes=4 cost=2
%y3 = compute "mm" %y2 @3 bytes=4 cost=2
output %y3
)";
  PipelineOptions options;
  options.gather_bucket_bytes = 6;  // one weight a bucket
  options.memory_budget_bytes = 18;
  options.gather_cost = CollectiveCost{0.0, 1.0};
  options.reduce_cost = CollectiveCost{0.0, 1.0};
  auto schedule = [&](const std::vector<std::string>& off) {
    PipelineOptions o = options;
    o.disabled_passes = off;
    Graph g = parse(lowered);
    make_pipeline(o).run(g);
    return g;
  };
  const Graph by_cost = schedule({});
  const Graph one_ahead = schedule({"prefetch_by_cost"});
  const CollectiveCostModel costs{options.gather_cost, options.reduce_cost};
  EXPECT_TRUE(verify(by_cost, VerifyOptions::complete().cap_gathered(18)).empty());
  EXPECT_LE(peak_gathered(by_cost).bytes, 18);
  EXPECT_DOUBLE_EQ(predict(one_ahead, costs).exposed_us, 14.0);
  EXPECT_DOUBLE_EQ(predict(by_cost, costs).exposed_us, 8.0);
}

}  // namespace
}  // namespace sharc::ir
