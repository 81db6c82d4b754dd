#include <gtest/gtest.h>

#include "pass_test_util.h"
#include "sharc/compiler/passes.h"

namespace sharc::ir {
namespace {

using testing::canonical;
using testing::run_pass;

TEST(RegatherInBackward, SavedParameterBecomesADirectRead) {
  auto pass = make_regather_in_backward();
  int64_t rewrites = 0;
  const std::string out = run_pass(*pass, R"(
param @0 "fc.weight" bytes=64
%w = input param=@0
%dy = input bytes=16
%dx = compute "mm" %dy %w bytes=16
output %dx
)", &rewrites);
  EXPECT_EQ(out, canonical(R"(
param @0 "fc.weight" bytes=64
%dy = input bytes=16
%dx = compute "mm" %dy @0 bytes=16
output %dx
)"));
  EXPECT_EQ(rewrites, 1);
}

TEST(RegatherInBackward, ForwardStopsReturningFullParameters) {
  auto pass = make_regather_in_backward();
  const std::string out = run_pass(*pass, R"(
param @0 "fc.weight" bytes=64
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
output %y @0 %x
)");
  EXPECT_EQ(out, canonical(R"(
param @0 "fc.weight" bytes=64
%x = input bytes=16
%y = compute "mm" %x @0 bytes=16
output %y %x
)"));
}

// What the bridge really hands over: its recompute tags put a fresh gather
// (a direct read) in backward, so the safety net finds no saved parameter.
TEST(RegatherInBackward, GraphsFromTheBridgeGiveItNothingToDo) {
  auto pass = make_regather_in_backward();
  const char* in = R"(
param @0 "fc.weight" bytes=64
%dy = input bytes=16
%dx = compute "mm" %dy @0 bytes=16
output %dx
)";
  int64_t rewrites = -1;
  EXPECT_EQ(run_pass(*pass, in, &rewrites), canonical(in));
  EXPECT_EQ(rewrites, 0);
}

TEST(RegatherInBackward, Contract) {
  const Contract c = make_regather_in_backward()->contract();
  EXPECT_TRUE(c.required.empty());
  EXPECT_EQ(c.established, (std::vector<Rule>{Rule::NoSavedParams}));
  EXPECT_TRUE(c.undone.empty());
}

TEST(RegatherInBackward, NothingToDo) {
  testing::expect_nothing_to_do(*make_regather_in_backward());
}

}  // namespace
}  // namespace sharc::ir
