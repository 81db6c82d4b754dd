// The memory model, the budget and the passes that spend it: kept
// parameters (selective unsharding), bucketing and prefetching under a cap.

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/memory.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

using testing::expect_nothing_to_do;

// Forward of three layers, as the bridge lowers it: each reads its weight.
const char* kThreeLayers = R"(
param @0 "a.weight" bytes=1000
param @1 "b.weight" bytes=1000
param @2 "ln.weight" bytes=10
%x = input bytes=40
%h = compute "mm" %x @0 bytes=40
%n = compute "mul" %h @2 bytes=40
%y = compute "mm" %n @1 bytes=40
output %y
)";

// 100 us latency, 1 us per 100 bytes: small parameters cost mostly latency.
const CollectiveCost kCost{100.0, 0.01};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(MemoryModel, KeptRoundTripsAndIsResident) {
  const char* text = "param @0 \"w\" bytes=8 dtype=float32 kept\n%x = input bytes=4\noutput %x\n";
  const Graph g = parse(text);
  EXPECT_TRUE(g.params.at(0).kept);
  EXPECT_EQ(print(g), text);
  EXPECT_EQ(kept_bytes(g), 8);
  EXPECT_EQ(peak_gathered(g).bytes, 8);  // resident with nothing gathered
  EXPECT_NE(error_of([] { parse("param @0 \"w\" bytes=8 kept kept\n"); }).find("'kept' given twice"),
            std::string::npos);
}

TEST(MemoryModel, CountsBuffersFromGatherToReleaseAndStagingUntilTheWait) {
  const Graph g = parse(R"(
param @0 "a" bytes=100
param @1 "b" bytes=30
param @2 "k" bytes=7 kept
%g = gather @0 @1 @2
%a, %b, %k = wait %g
%y = compute "mm" %a %b %k bytes=4
release @0 after %y
release @1 after %y
release @2 after %y
output %y
)");
  const GatheredPeak peak = peak_gathered(g);
  // Kept 7 all along; the bucket's two buffers (130) and its staging (137:
  // the kept member is gathered again through it once a step).
  EXPECT_EQ(peak.bytes, 7 + 130 + 137);
  EXPECT_EQ(peak.node, 0u);
  EXPECT_EQ(describe(g, peak), "274 bytes gathered after node 0 (gather)");
}

TEST(MemoryBudget, BelowTheSmallestFeasibleBudgetNamesIt) {
  // The plain schedule holds one parameter at a time (each is released
  // right after its one use): at most a weight, 1000 bytes.
  const GatheredPeak plain = plain_schedule_peak(parse(kThreeLayers));
  EXPECT_EQ(plain.bytes, 1000);
  Graph g = parse(kThreeLayers);
  const std::string msg = error_of([&] { make_check_memory_budget(999)->run(g); });
  EXPECT_NE(msg.find("memory_budget_bytes=999 is below the smallest budget this graph can run "
                     "in, 1000 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("raise memory_budget_bytes to at least 1000"), std::string::npos) << msg;
  EXPECT_EQ(make_check_memory_budget(1000)->run(g), 0);
  expect_nothing_to_do(*make_check_memory_budget(1));
}

TEST(MemoryBudget, TheLargestParameterIsCountedInTheDtypeItIsGathered) {
  // a.weight is read only through a bf16 cast: gathered bf16, 500 bytes; the
  // norm weight, read in fp32, stays; a gradient alone is no read.
  const Graph g = parse(R"(
param @0 "a.weight" bytes=1000 dtype=float32
param @1 "ln.weight" bytes=600 dtype=float32
param @2 "b.weight" bytes=4000 dtype=float32
%x = input bytes=40
%wb = compute "prims.convert_element_type.default" @0 bytes=500 cast=bfloat16
%h = compute "mm" %x %wb bytes=40
%n = compute "mul" %h @1 bytes=40
%g = compute "grad" %n bytes=4000 grad=@2
output %n
)");
  EXPECT_EQ(largest_gathered_param(g, shipping_pipeline({})), 600);
  PipelineOptions naive;  // cast_before_gather off: gathered in fp32
  naive.disabled_passes = {"cast_before_gather"};
  EXPECT_EQ(largest_gathered_param(g, shipping_pipeline(naive)), 1000);
  EXPECT_EQ(largest_gathered_param(parse("%x = input bytes=4\noutput %x\n"),
                                   shipping_pipeline({})), 0);
}

TEST(MemoryBudget, TheShippedPipelineStaysWithinEveryFeasibleBudget) {
  for (int64_t budget : {1000, 1010, 2000, 2030, 5000}) {
    PipelineOptions options;
    options.memory_budget_bytes = budget;
    options.gather_cost = kCost;
    options.keep_for_backward = true;
    Graph g = parse(kThreeLayers);
    make_pipeline(options).run(g);  // the final rules check the cap too
    EXPECT_LE(peak_gathered(g).bytes, budget) << print(g);
  }
}

TEST(MemoryBudget, WithoutABudgetBucketingAndPrefetchSpendMore) {
  PipelineOptions options;
  options.gather_bucket_bytes = 1 << 20;
  Graph free = parse(kThreeLayers);
  make_pipeline(options).run(free);
  // One bucket of all three, its staging too.
  EXPECT_EQ(peak_gathered(free).bytes, 2 * 2010);
  options.memory_budget_bytes = 2100;
  Graph capped = parse(kThreeLayers);
  make_pipeline(options).run(capped);
  EXPECT_LE(peak_gathered(capped).bytes, 2100) << print(capped);
}

TEST(MemoryBudget, TheVerifierNamesAScheduleAboveTheCap) {
  const Graph g = parse(R"(
param @0 "a" bytes=100
%g = gather @0
%a = wait %g
%y = compute "mm" %a bytes=4
release @0 after %y
output %y
)");
  VerifyOptions rules = VerifyOptions::structural();
  rules.cap_gathered(99);
  const auto errors = verify(g, rules);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "the schedule holds 100 bytes gathered after node 0 (gather), above the "
                       "memory budget of 99 bytes");
  rules.cap_gathered(100);
  EXPECT_TRUE(verify(g, rules).empty());
}

TEST(KeepGatheredParams, KeepsTheMostTimeSavedPerByteWithinHalfTheHeadroom) {
  // Headroom above the plain peak (1000): 1030; half of it, 515, fits
  // ln.weight (10 bytes, 101 us) but neither weight (1000 bytes each).
  int64_t kept = 0;
  auto pass = make_keep_gathered_params(2030, kCost);
  const Graph g = parse(testing::run_pass(*pass, kThreeLayers, &kept));
  EXPECT_EQ(kept, 1);
  EXPECT_TRUE(g.params.at(2).kept);
  EXPECT_FALSE(g.params.at(0).kept);
  // Room for one weight too: the smaller id first among equals.
  const Graph more = parse(testing::run_pass(*make_keep_gathered_params(4020, kCost),
                                             kThreeLayers, &kept));
  EXPECT_EQ(kept, 2);
  EXPECT_TRUE(more.params.at(2).kept && more.params.at(0).kept);
  EXPECT_FALSE(more.params.at(1).kept);
}

TEST(KeepGatheredParams, OnlyCandidatesTheBackwardReadsAgain) {
  int64_t kept = 0;
  // ln.weight (@2) is the best buy, but the backward never reads it.
  const Graph g = parse(testing::run_pass(
      *make_keep_gathered_params(4020, kCost, std::set<int64_t>{0, 1}), kThreeLayers, &kept));
  EXPECT_EQ(kept, 1);
  EXPECT_TRUE(g.params.at(0).kept);
  EXPECT_FALSE(g.params.at(2).kept);
}

TEST(KeepGatheredParams, NothingWithoutACostOrABudget) {
  int64_t kept = -1;
  testing::run_pass(*make_keep_gathered_params(std::nullopt, kCost), kThreeLayers, &kept);
  EXPECT_EQ(kept, 0);
  testing::run_pass(*make_keep_gathered_params(100000, std::nullopt), kThreeLayers, &kept);
  EXPECT_EQ(kept, 0);
  expect_nothing_to_do(*make_keep_gathered_params(100000, kCost));
}

TEST(KeepGatheredParams, OnlyForwardGraphsKeepInTheShippedPipeline) {
  PipelineOptions options;
  options.memory_budget_bytes = 4020;
  options.gather_cost = kCost;
  Graph backward = parse(kThreeLayers);
  make_pipeline(options).run(backward);
  EXPECT_EQ(kept_bytes(backward), 0);
  options.keep_for_backward = true;
  Graph forward = parse(kThreeLayers);
  make_pipeline(options).run(forward);
  EXPECT_EQ(kept_bytes(forward), 1010);
}

TEST(AutoBucket, LatencyIsATenthOfTheTransfer) {
  EXPECT_EQ(auto_gather_bucket_bytes(std::nullopt), 64 << 10);
  EXPECT_EQ(auto_gather_bucket_bytes(CollectiveCost{100.0, 0.001}), 900000);
  EXPECT_EQ(auto_gather_bucket_bytes(CollectiveCost{1.0, 0.001}), 64 << 10);   // clamped up
  EXPECT_EQ(auto_gather_bucket_bytes(CollectiveCost{1e6, 1e-9}), 64 << 20);    // clamped down
  // Time that did not grow with the bytes is all latency: the largest bucket.
  EXPECT_EQ(auto_gather_bucket_bytes(CollectiveCost{100.0, 0.0}), 64 << 20);
  EXPECT_EQ(auto_gather_bucket_bytes(CollectiveCost{0.0, 0.0}), 64 << 10);     // took no time
  // Reductions: the same rule, at least 1 MiB; 4 MiB unmeasured.
  EXPECT_EQ(auto_reduce_bucket_bytes(std::nullopt), 4 << 20);
  EXPECT_EQ(auto_reduce_bucket_bytes(CollectiveCost{200.0, 0.0001}), 18000000);
  EXPECT_EQ(auto_reduce_bucket_bytes(CollectiveCost{100.0, 0.001}), 1 << 20);  // clamped up
  EXPECT_EQ(auto_reduce_bucket_bytes(CollectiveCost{37.8, 0.0}), 64 << 20);
}

TEST(AnnotateCollectiveCosts, PredictedTimesOnCollectives) {
  PipelineOptions options;
  options.gather_cost = kCost;
  options.reduce_cost = CollectiveCost{200.0, 0.0};
  Graph g = parse(R"(
param @0 "w" bytes=1000
%dy = input bytes=16
%dx = compute "mm" %dy @0 bytes=16
%dw = compute "mm" %dy %dy bytes=1000 grad=@0
output %dx
)");
  make_pipeline(options).run(g);
  const std::string text = print(g);
  EXPECT_NE(text.find("gather @0 cost=110"), std::string::npos) << text;
  EXPECT_NE(text.find("reduce_scatter @0 %dw cost=200"), std::string::npos) << text;
}

}  // namespace
}  // namespace sharc::ir
