// Pipelines as text: parse, print, build; the shipping pipeline written out
// schedules exactly as the options it came from.

#include <gtest/gtest.h>

#include "sharc/compiler/ir.h"
#include "sharc/compiler/pipeline.h"
#include "sharc/compiler/pipeline_text.h"
#include "sharc/core/error.h"

namespace sharc::ir {
namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PipelineText, ParsesAndPrints) {
  const PipelineSpec p = parse_pipeline(
      " regather_in_backward ,\n -prefetch_gathers,bucket_allgathers{ bytes=4096 , budget=none}");
  ASSERT_EQ(p.size(), 3u);
  EXPECT_TRUE(p[0].enabled);
  EXPECT_FALSE(p[1].enabled);
  EXPECT_EQ(p[1].name, "prefetch_gathers");
  EXPECT_EQ(p[2].args.at("bytes"), "4096");
  EXPECT_EQ(p[2].args.at("budget"), "none");
  const std::string text = print_pipeline(p);
  EXPECT_EQ(text, "regather_in_backward,-prefetch_gathers,bucket_allgathers{budget=none,bytes=4096}");
  EXPECT_EQ(print_pipeline(parse_pipeline(text)), text);
  EXPECT_TRUE(parse_pipeline("  ").empty());
}

TEST(PipelineText, BadTextSaysWhatIsWrong) {
  EXPECT_NE(error_of([] { parse_pipeline("a,,b"); }).find("an empty pass"), std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a{b=1"); }).find("never closed"), std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a{b{=1}}"); }).find("braces do not pair"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a{b}"); }).find("is not key=value"), std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a{b=1,b=2}"); }).find("given twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a b"); }).find("is not a pass name"), std::string::npos);
  EXPECT_NE(error_of([] { parse_pipeline("a{b=1}x"); }).find("text after the arguments"),
            std::string::npos);
}

TEST(PipelineText, MakePassNamesUnknownPassesArgumentsAndValues) {
  EXPECT_NE(error_of([] { make_pass({"frobnicate"}); })
                .find("no pass named 'frobnicate'; passes are: annotate_collective_costs"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_pass({"bucket_allgathers", true, {{"bytes", "1"}, {"x", "2"}}}); })
                .find("takes no argument 'x' (its arguments: budget bytes)"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_pass({"place_reduce_waits", true, {{"x", "2"}}}); })
                .find("(it takes none)"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_pass({"bucket_allgathers"}); }).find("needs bytes=N"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_pass({"insert_reduce_scatter", true, {{"bytes", "1e3"}}}); })
                .find("is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_pass({"prefetch_by_cost", true, {{"gather_latency_us", "1"}}});
            }).find("takes gather_latency_us and gather_us_per_byte together"),
            std::string::npos);
  EXPECT_EQ(make_pass({"keep_gathered_params", true, {{"candidates", "0:3:5"}}})->name(),
            "keep_gathered_params");
}

const char* kGraph = R"(
param @0 "a" bytes=4096 dtype=float32
param @1 "b" bytes=64 dtype=float32
param @2 "c" bytes=4096 dtype=float32
%x = input bytes=1024
%y = compute "mm" %x @0 bytes=2048 cost=12.5
%z = compute "add" %y @1 bytes=2048 cost=1.5
%h = compute "mm" %z @2 bytes=1024 cost=11
%dw2 = compute "mm_grad" %z %h bytes=4096 grad=@2 cost=9
%dw0 = compute "mm_grad" %x %y bytes=4096 grad=@0 cost=9
%db = compute "sum" %z bytes=64 grad=@1 cost=0.5
output %h
)";

std::string schedule_with(PassManager manager) {
  Graph g = parse(kGraph);
  manager.run(g);
  return print(g);
}

TEST(PipelineText, TheShippingPipelineWrittenOutSchedulesAsItsOptions) {
  PipelineOptions options;
  options.memory_budget_bytes = 12000;
  options.gather_cost = CollectiveCost{20.0 / 3.0, 0.0021};  // not exact in decimal
  options.reduce_cost = CollectiveCost{30.0, 0.003};
  options.keep_for_backward = true;
  options.keep_candidates = std::set<int64_t>{0, 1};
  options.disabled_passes = {"prefetch_gathers"};
  const std::string text = print_pipeline(shipping_pipeline(options));
  EXPECT_NE(text.find("-prefetch_gathers"), std::string::npos) << text;
  EXPECT_NE(text.find("candidates=0:1"), std::string::npos) << text;
  EXPECT_EQ(schedule_with(build_pipeline(parse_pipeline(text))),
            schedule_with(make_pipeline(options)));
  // The budget written in the text caps the final verification.
  EXPECT_NE(error_of([] {
              Graph g = parse(kGraph);
              build_pipeline(parse_pipeline(
                                 "insert_gather_release,check_memory_budget{budget=100}"))
                  .run(g);
            }).find("must run before 'gathers inserted'"),
            std::string::npos);
}

TEST(PipelineText, CompletionFillsWhatATextLeavesOut) {
  PipelineOptions facts;
  facts.memory_budget_bytes = 9000;
  const PipelineSpec done =
      complete_pipeline(parse_pipeline("bucket_allgathers{bytes=4096},prefetch_gathers"), facts);
  EXPECT_EQ(print_pipeline(done),
            "bucket_allgathers{budget=9000,bytes=4096},prefetch_gathers{budget=9000}");
}

TEST(PipelineText, NumbersReadBackExactly) {
  for (double v : {0.1, 20.0 / 3.0, 1e-9, 123456.789, 0.0}) {
    EXPECT_EQ(std::stod(format_number(v)), v);
  }
}

}  // namespace
}  // namespace sharc::ir
