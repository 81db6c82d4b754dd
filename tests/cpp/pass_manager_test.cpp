#include <gtest/gtest.h>

#include "sharc/error.h"
#include "sharc/pass.h"
#include "sharc/passes.h"
#include "sharc/pipeline.h"

namespace sharc::ir {
namespace {

// A forward+backward pair the way the bridge hands them over: parameters read
// directly, a full parameter saved for backward, gradients unreduced.
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
PassManager default_pipeline() {
  PipelineOptions options;
  options.gather_bucket_bytes = 1 << 20;
  options.reduce_bucket_bytes = 1 << 20;
  return make_pipeline(options);
}

TEST(PassManager, RunsThePipelineAndVerifiesTheResult) {
  Graph g = parse(kBackwardFromBridge);
  const auto records = default_pipeline().run(g);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0].name, "regather_in_backward");
  EXPECT_EQ(records[0].rewrites, 1);
  EXPECT_EQ(records[1].rewrites, 1);
  EXPECT_EQ(records[3].name, "prefetch_gathers");
  EXPECT_EQ(records[3].rewrites, 0);  // one gather: nothing to move it ahead of
  EXPECT_EQ(records[4].rewrites, 1);  // one bucket for both gradients
  EXPECT_TRUE(verify(g).empty());
  EXPECT_EQ(print(g),
            "param @0 \"fc.weight\" bytes=64\n"
            "param @1 \"fc.bias\" bytes=8\n"
            "%x = input bytes=16\n"
            "%dy = input bytes=16\n"
            "%sharc_gather_0 = gather @0\n"
            "%sharc_full_0 = wait %sharc_gather_0\n"
            "%dx = compute \"mm\" %dy %sharc_full_0 bytes=16\n"
            "release @0 after %dx\n"
            "%dw = compute \"mm\" %dy %x bytes=64 grad=@0\n"
            "%db = compute \"sum\" %dy bytes=8 grad=@1\n"
            "reduce_scatter @0 @1 %dw %db\n"
            "output %dx\n");
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
  EXPECT_TRUE(records[2].skipped);
  EXPECT_FALSE(records[1].skipped);
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
  ASSERT_EQ(seen.size(), 10u);
  EXPECT_EQ(seen[0], "regather_in_backward:before:1");
  EXPECT_EQ(seen[9], "insert_reduce_scatter:after:1");
}

TEST(PassManager, PipelineNamesItsPassesInOrder) {
  EXPECT_EQ(pipeline_pass_names(),
            (std::vector<std::string>{"regather_in_backward", "insert_gather_release",
                                      "bucket_allgathers", "prefetch_gathers",
                                      "insert_reduce_scatter"}));
  PipelineOptions options;
  options.disabled_passes = {"prefetch_gathers"};
  Graph g = parse(kBackwardFromBridge);
  EXPECT_TRUE(make_pipeline(options).run(g)[3].skipped);
  options.disabled_passes = {"prefetch"};
  EXPECT_THROW(make_pipeline(options), Error);
}

TEST(PassManager, APassNameIsAddedOnce) {
  PassManager pm;
  pm.add(make_prefetch_gathers());
  EXPECT_THROW(pm.add(make_prefetch_gathers()), Error);
}

TEST(PassManager, InvalidInputIsRejectedBeforeAnyPass) {
  Graph g = parse("%y = compute \"a\" %undefined bytes=4\n");
  EXPECT_THROW(default_pipeline().run(g), Error);
}

}  // namespace
}  // namespace sharc::ir
