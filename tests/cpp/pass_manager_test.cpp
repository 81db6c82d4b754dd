#include <gtest/gtest.h>

#include "sharc/core/error.h"
#include "sharc/compiler/pass.h"
#include "sharc/compiler/passes.h"
#include "sharc/compiler/pipeline.h"

namespace sharc::ir {
namespace {

// A backward graph as a partitioner that saved a full parameter for backward
// would hand it over: parameters read directly, the saved full parameter an
// input, gradients unreduced. The bridge's recompute tags keep such inputs
// out of its graphs (see kBackwardAsLowered); regather_in_backward is the
// safety net for graphs that still have one.
const char* kBackwardFromBridge = R"(
param @0 "fc.weight" bytes=64
param @1 "fc.bias" bytes=8
%w = input param=@0
%x = input bytes=16
%dy = input bytes=16
%dx = compute "mm" %dy %w bytes=16
%dw = compute "mm" %dy %x bytes=64 grad=@0
%db = compute "sum" %dy bytes=8 grad=@1
output %dx
)";

// The shipping pipeline, with buckets large enough to take everything.
// The same backward as the bridge lowers it: the gather recomputed in
// backward, so the parameter is read directly instead of received.
const char* kBackwardAsLowered = R"(
param @0 "fc.weight" bytes=64
param @1 "fc.bias" bytes=8
%x = input bytes=16
%dy = input bytes=16
%dx = compute "mm" %dy @0 bytes=16
%dw = compute "mm" %dy %x bytes=64 grad=@0
%db = compute "sum" %dy bytes=8 grad=@1
output %dx
)";

std::string refusal(const PassManager& pm);

// The record of the pass named `name`.
const PassRecord& record(const std::vector<PassRecord>& records, const std::string& name) {
  for (const PassRecord& r : records) {
    if (r.name == name) return r;
  }
  throw Error("no pass named " + name);
}

PassManager default_pipeline() {
  PipelineOptions options;
  options.gather_bucket_bytes = 1 << 20;
  options.reduce_bucket_bytes = 1 << 20;
  return make_pipeline(options);
}

TEST(PassManager, RunsThePipelineAndVerifiesTheResult) {
  Graph g = parse(kBackwardFromBridge);
  const auto records = default_pipeline().run(g);
  ASSERT_EQ(records.size(), pipeline_pass_names().size());
  EXPECT_EQ(records[0].name, "regather_in_backward");
  EXPECT_EQ(records[0].rewrites, 1);
  EXPECT_EQ(records[1].name, "cast_before_gather");
  EXPECT_EQ(records[1].rewrites, 0);  // no dtypes, no casts
  EXPECT_EQ(record(records, "check_memory_budget").rewrites, 0);    // no budget
  EXPECT_EQ(record(records, "keep_gathered_params").rewrites, 0);   // no budget, no cost
  EXPECT_EQ(record(records, "insert_gather_release").rewrites, 1);
  EXPECT_EQ(record(records, "prefetch_gathers").rewrites, 0);  // one gather: nothing to move
  EXPECT_EQ(record(records, "insert_reduce_scatter").rewrites, 1);  // one bucket for both
  EXPECT_EQ(record(records, "place_reduce_waits").rewrites, 1);     // its one wait
  EXPECT_EQ(record(records, "mark_graph_prefetch").rewrites, 2);    // after wait, release
  EXPECT_EQ(record(records, "annotate_collective_costs").rewrites, 0);  // nothing measured
  EXPECT_TRUE(verify(g).empty());
  EXPECT_EQ(print(g),
            "param @0 \"fc.weight\" bytes=64\n"
            "param @1 \"fc.bias\" bytes=8\n"
            "%x = input bytes=16\n"
            "%dy = input bytes=16\n"
            "%sharc_gather_0 = gather @0\n"
            "%sharc_full_0 = wait %sharc_gather_0\n"
            "prefetch_next @0 bytes=-1\n"
            "%dx = compute \"mm\" %dy %sharc_full_0 bytes=16\n"
            "release @0 after %dx\n"
            "prefetch_next @0 after %dx bytes=-1\n"
            "%dw = compute \"mm\" %dy %x bytes=64 grad=@0\n"
            "%db = compute \"sum\" %dy bytes=8 grad=@1\n"
            "%sharc_reduce_0 = reduce_scatter @0 @1 %dw %db\n"
            "%sharc_shard_grad_0, %sharc_shard_grad_1 = wait_reduce %sharc_reduce_0\n"
            "output %dx %sharc_shard_grad_0 %sharc_shard_grad_1\n");
}

// Two reduction buckets: the first is waited on right after the second
// starts, the second right before the output, which returns every shard
// gradient.
TEST(PassManager, ReductionsAreWaitedOnOneBucketBehind) {
  Graph g = parse(kBackwardAsLowered);
  PipelineOptions options;
  options.reduce_bucket_bytes = 64;  // fc.weight's gradient fills one bucket
  const auto records = make_pipeline(options).run(g);
  EXPECT_EQ(record(records, "insert_reduce_scatter").rewrites, 2);
  EXPECT_EQ(record(records, "place_reduce_waits").rewrites, 2);
  EXPECT_EQ(print(g),
            "param @0 \"fc.weight\" bytes=64\n"
            "param @1 \"fc.bias\" bytes=8\n"
            "%x = input bytes=16\n"
            "%dy = input bytes=16\n"
            "%sharc_gather_0 = gather @0\n"
            "%sharc_full_0 = wait %sharc_gather_0\n"
            "prefetch_next @0 bytes=-1\n"
            "%dx = compute \"mm\" %dy %sharc_full_0 bytes=16\n"
            "release @0 after %dx\n"
            "prefetch_next @0 after %dx bytes=-1\n"
            "%dw = compute \"mm\" %dy %x bytes=64 grad=@0\n"
            "%sharc_reduce_0 = reduce_scatter @0 %dw\n"
            "%db = compute \"sum\" %dy bytes=8 grad=@1\n"
            "%sharc_reduce_1 = reduce_scatter @1 %db\n"
            "%sharc_shard_grad_0 = wait_reduce %sharc_reduce_0\n"
            "%sharc_shard_grad_1 = wait_reduce %sharc_reduce_1\n"
            "output %dx %sharc_shard_grad_0 %sharc_shard_grad_1\n");
}

TEST(PassManager, ReductionsNobodyWaitsOnFailAtTheEnd) {
  Graph g = parse(kBackwardAsLowered);
  PassManager pm = default_pipeline();
  pm.disable("place_reduce_waits");
  try {
    pm.run(g);
    FAIL() << "a reduction nobody waits on never delivers its gradients";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("reduction %sharc_reduce_0 (@0 @1) is never waited on"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("switched off (place_reduce_waits)"), std::string::npos) << msg;
  }
  PassManager without_reductions = default_pipeline();
  without_reductions.disable("insert_reduce_scatter");
  EXPECT_EQ(refusal(without_reductions),
            "sharc: pass 'prefetch_by_cost' requires 'gradients reduced', which no earlier "
            "pass established; enable 'insert_reduce_scatter'");
}

TEST(PassManager, SavedParameterOrRecomputedGatherGiveTheSameSchedule) {
  Graph saved = parse(kBackwardFromBridge);
  Graph lowered = parse(kBackwardAsLowered);
  default_pipeline().run(saved);
  const auto records = default_pipeline().run(lowered);
  EXPECT_EQ(records[0].name, "regather_in_backward");
  EXPECT_EQ(records[0].rewrites, 0);  // the safety net has nothing to catch
  EXPECT_EQ(print(lowered), print(saved));
}

TEST(PassManager, SwitchingOffAPassThatEstablishesARuleFailsVerification) {
  Graph g = parse(kBackwardFromBridge);
  PassManager pm = default_pipeline();
  pm.disable("regather_in_backward");
  try {
    pm.run(g);
    FAIL() << "without re-gather the backward keeps a saved full parameter";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("at the end of the pass pipeline"), std::string::npos) << msg;
    EXPECT_NE(msg.find("saved by forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("switched off (regather_in_backward)"), std::string::npos) << msg;
  }
}

TEST(PassManager, SkippedPassesAreReported) {
  Graph g = parse(kBackwardFromBridge);
  PassManager pm = default_pipeline();
  pm.disable("bucket_allgathers");
  const auto records = pm.run(g);
  EXPECT_TRUE(record(records, "bucket_allgathers").skipped);
  EXPECT_FALSE(record(records, "insert_gather_release").skipped);
}

TEST(PassManager, UnknownPassNameIsAnError) {
  PassManager pm = default_pipeline();
  try {
    pm.disable("prefetch");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("insert_reduce_scatter"), std::string::npos);
  }
}

TEST(PassManager, PrintsBeforeAndAfterEachPass) {
  Graph g = parse(kBackwardFromBridge);
  PassManager pm = default_pipeline();
  std::vector<std::string> seen;
  pm.set_printer([&](const std::string& pass, const std::string& when, const std::string& ir) {
    seen.push_back(pass + ":" + when + ":" + std::to_string(ir.size() > 0));
  });
  pm.run(g);
  ASSERT_EQ(seen.size(), 2 * pipeline_pass_names().size());
  EXPECT_EQ(seen[0], "regather_in_backward:before:1");
  EXPECT_EQ(seen.back(), "annotate_collective_costs:after:1");
}

TEST(PassManager, PipelineNamesItsPassesInOrder) {
  EXPECT_EQ(pipeline_pass_names(),
            (std::vector<std::string>{"regather_in_backward", "cast_before_gather",
                                      "check_memory_budget", "keep_gathered_params",
                                      "insert_gather_release", "bucket_allgathers",
                                      "prefetch_gathers", "insert_reduce_scatter",
                                      "prefetch_by_cost", "place_reduce_waits",
                                      "insert_replicate_all_reduce",
                                      "mark_graph_prefetch", "annotate_collective_costs"}));
  PipelineOptions options;
  options.disabled_passes = {"prefetch_gathers"};
  Graph g = parse(kBackwardFromBridge);
  EXPECT_TRUE(record(make_pipeline(options).run(g), "prefetch_gathers").skipped);
  options.disabled_passes = {"prefetch"};
  EXPECT_THROW(make_pipeline(options), Error);
}

TEST(PassManager, APassNameIsAddedOnce) {
  PassManager pm;
  pm.add(make_prefetch_gathers());
  EXPECT_THROW(pm.add(make_prefetch_gathers()), Error);
}

// Runs `pm` on the bridge's graph and returns the sharc::Error it throws.
std::string refusal(const PassManager& pm) {
  Graph g = parse(kBackwardFromBridge);
  try {
    pm.run(g);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "the pass manager ran a pass whose required rule did not hold";
  return "";
}

TEST(PassManager, RequiredRuleThatNoEarlierPassEstablishedNamesThePassToEnable) {
  PassManager pm = default_pipeline();
  pm.disable("insert_gather_release");
  EXPECT_EQ(refusal(pm),
            "sharc: pass 'bucket_allgathers' requires 'each wait right after its gather', "
            "which no earlier pass established; enable 'insert_gather_release'");
  pm.disable("bucket_allgathers");
  EXPECT_EQ(refusal(pm),
            "sharc: pass 'prefetch_gathers' requires 'gathers inserted', which no earlier "
            "pass established; enable 'insert_gather_release'");
}

TEST(PassManager, RequiredRuleEstablishedOnlyLaterNamesThePassToRunFirst) {
  PassManager pm;
  pm.add(make_prefetch_gathers()).add(make_insert_gather_release());
  EXPECT_EQ(refusal(pm),
            "sharc: pass 'prefetch_gathers' requires 'gathers inserted', which no earlier "
            "pass established; run it after 'insert_gather_release'");
  PassManager alone;
  alone.add(make_prefetch_gathers());
  EXPECT_NE(refusal(alone).find("no pass in the pipeline establishes it"), std::string::npos);
}

TEST(PassManager, RequiredRuleUndoneByAnEarlierPassNamesThatPass) {
  PassManager pm;
  pm.add(make_insert_gather_release()).add(make_prefetch_gathers()).add(
      make_bucket_allgathers(1 << 20));
  EXPECT_EQ(refusal(pm),
            "sharc: pass 'bucket_allgathers' requires 'each wait right after its gather', "
            "which pass 'prefetch_gathers' undid; run it before 'prefetch_gathers'");
}

TEST(PassManager, PassThatMustPrecedeAnEstablishedRuleNamesThePassToRunAfter) {
  PassManager pm;
  pm.add(make_insert_gather_release()).add(make_cast_before_gather());
  EXPECT_EQ(refusal(pm),
            "sharc: pass 'cast_before_gather' must run before 'gathers inserted' holds, but "
            "pass 'insert_gather_release' established it; run it before "
            "'insert_gather_release'");
  PassManager right_order(VerifyOptions::structural(),
                          VerifyOptions::complete().waive(Rule::GradientsReduced));
  right_order.add(make_cast_before_gather()).add(make_insert_gather_release());
  Graph g = parse(kBackwardAsLowered);
  EXPECT_EQ(right_order.run(g).size(), 2u);
}

TEST(PassManager, PassThatMustPrecedeARuleTheInputSatisfiesIsRefused) {
  Graph g = parse(
      "param @0 \"w\" bytes=64\n%x = input bytes=4\n%g = gather @0\n%w = wait %g\n"
      "%y = compute \"a\" %x %w bytes=4\nrelease @0 after %y\noutput %y\n");
  PassManager pm(VerifyOptions::structural().require(Rule::GathersInserted),
                 VerifyOptions::structural());
  pm.add(make_cast_before_gather());
  try {
    pm.run(g);
    FAIL() << "cast_before_gather ran on a graph with gathers inserted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "sharc: pass 'cast_before_gather' must run before 'gathers inserted' holds, but "
              "the pipeline's input already satisfies it; switch it off");
  }
}

TEST(PassManager, InputRulesHoldBeforeTheFirstPass) {
  Graph g = parse(
      "param @0 \"w\" bytes=64\n%x = input bytes=4\n%g = gather @0\n%w = wait %g\n"
      "%y = compute \"a\" %x %w bytes=4\nrelease @0 after %y\noutput %y\n");
  PassManager pm(VerifyOptions::structural().require(Rule::GathersInserted),
                 VerifyOptions::structural());
  pm.add(make_prefetch_gathers());
  EXPECT_EQ(pm.run(g)[0].rewrites, 0);
}

TEST(PassManager, InvalidInputIsRejectedBeforeAnyPass) {
  Graph g = parse("%y = compute \"a\" %undefined bytes=4\n");
  EXPECT_THROW(default_pipeline().run(g), Error);
}

TEST(PassManager, AnalysesAreComputedOnceAndAgainOnlyAfterAPassThatChangesThem) {
  Graph g = parse(
      "param @0 \"a\" bytes=4096\n"
      "param @1 \"b\" bytes=64\n"
      "%x = input bytes=16\n"
      "%y = compute \"mm\" %x @0 bytes=16\n"
      "%z = compute \"add\" %y @1 bytes=16\n"
      "output %z\n");
  const PassManager manager = build_pipeline(parse_pipeline(
      "check_memory_budget{budget=100000},"
      "keep_gathered_params{budget=100000,gather_latency_us=50,gather_us_per_byte=0.01},"
      "insert_gather_release"));
  Analyses analyses(g);
  manager.run(g, analyses);
  // check_memory_budget and keep_gathered_params both weigh the plain
  // schedule: computed once (the first preserves it).
  EXPECT_EQ(analyses.computed(Analysis::PlainSchedulePeak), 1);
  // The input's verification, both passes that preserve it and insertion
  // share one dependence; insertion moves nodes, so the verification after
  // it computes it again: 2, where recomputing per ask would be 5.
  EXPECT_EQ(analyses.computed(Analysis::Dependence), 2);
  EXPECT_TRUE(g.params.at(1).kept);
}

}  // namespace
}  // namespace sharc::ir
