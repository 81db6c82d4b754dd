#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "sharc/core/eager_holds.h"

namespace sharc {
namespace {

using Ids = std::vector<int64_t>;

TEST(ScopeStack, OnlyTheFirstScopeIsOutermost) {
  ScopeStack<std::string> scopes;
  EXPECT_FALSE(scopes.is_open());
  EXPECT_TRUE(scopes.open());
  EXPECT_FALSE(scopes.open());
  EXPECT_FALSE(scopes.innermost_is_outermost());
  scopes.close();
  EXPECT_TRUE(scopes.is_open());
  EXPECT_TRUE(scopes.innermost_is_outermost());  // what the outermost close keeps
  scopes.close();
  EXPECT_FALSE(scopes.is_open());
  EXPECT_FALSE(scopes.innermost_is_outermost());
}

TEST(ScopeStack, ARepeatedReadFindsWhatTheInnermostScopeHolds) {
  ScopeStack<std::string> scopes;
  EXPECT_EQ(scopes.find(1), nullptr);  // no scope open
  scopes.open();
  scopes.hold(1, "w1");
  ASSERT_NE(scopes.find(1), nullptr);
  EXPECT_EQ(*scopes.find(1), "w1");
  // A child's scope owns its own reads: the parent's gather is not shared.
  scopes.open();
  EXPECT_EQ(scopes.find(1), nullptr);
  scopes.hold(1, "w1 again");
  EXPECT_EQ(*scopes.find(1), "w1 again");
  EXPECT_EQ(scopes.close(), Ids{1});
  EXPECT_EQ(*scopes.find(1), "w1");
}

TEST(ScopeStack, AHoldForThePassIsSharedBySiblingScopesUntilTheOutermostCloses) {
  ScopeStack<std::string> scopes;
  scopes.open();  // the root
  scopes.open();  // the encoder's embedding reads the tied weight first
  EXPECT_EQ(scopes.find(5, /*for_pass=*/true), nullptr);
  scopes.hold(5, "tied", /*for_pass=*/true);
  scopes.hold(2, "own");
  EXPECT_EQ(scopes.close(), Ids{2});  // the tied hold outlives its first reader
  scopes.open();  // the output head, a sibling
  ASSERT_NE(scopes.find(5, /*for_pass=*/true), nullptr);
  EXPECT_EQ(*scopes.find(5, /*for_pass=*/true), "tied");
  EXPECT_EQ(scopes.find(5), nullptr);  // not the innermost scope's own
  EXPECT_TRUE(scopes.close().empty());
  EXPECT_EQ(scopes.close(), Ids{5});  // the pass ends
  EXPECT_FALSE(scopes.is_open());
}

TEST(ScopeStack, ClosingDropsTheScopesHoldsInReadOrderValuesFirst) {
  ScopeStack<std::shared_ptr<int>> scopes;
  auto full = std::make_shared<int>(7);
  scopes.open();
  scopes.hold(3, full);
  scopes.hold(1, std::make_shared<int>(8));
  EXPECT_EQ(full.use_count(), 2);
  EXPECT_EQ(scopes.close(), (Ids{3, 1}));
  EXPECT_EQ(full.use_count(), 1);  // only the reference from outside remains
}

TEST(ScopeStack, ClosingWithNoScopeOpenDropsNothing) {
  ScopeStack<int> scopes;
  EXPECT_TRUE(scopes.close().empty());
}

TEST(BackwardHolds, OneHoldPerParameterDroppedOnce) {
  BackwardHolds<std::string> holds;
  EXPECT_TRUE(holds.empty());
  holds.hold(4, "w4");
  ASSERT_NE(holds.find(4), nullptr);
  EXPECT_EQ(*holds.find(4), "w4");
  EXPECT_TRUE(holds.drop(4));   // the gather's backward ran
  EXPECT_FALSE(holds.drop(4));  // the end of backward finds it gone
  EXPECT_EQ(holds.find(4), nullptr);
}

TEST(BackwardHolds, TheEndOfBackwardDropsWhatIsLeftInIdOrder) {
  BackwardHolds<int> holds;
  holds.hold(9, 0);
  holds.hold(2, 0);
  holds.hold(5, 0);
  EXPECT_TRUE(holds.drop(5));
  EXPECT_EQ(holds.drop_all(), (Ids{2, 9}));
  EXPECT_TRUE(holds.empty());
  EXPECT_TRUE(holds.drop_all().empty());
}

TEST(BackwardCompanions, AScopesParametersAreGatheredTogetherInIdOrder) {
  BackwardCompanions companions;
  companions.close_scope({7, 3, 5}, {});  // read order is not the group's order
  for (int64_t id : {3, 5, 7}) EXPECT_EQ(companions.with(id), (Ids{3, 5, 7}));
  EXPECT_EQ(companions.with(4), (Ids{4}));  // never held: alone
}

TEST(BackwardCompanions, TiedAndUnitParametersStayOut) {
  BackwardCompanions companions;
  companions.close_scope({1, 2, 3}, {2});
  EXPECT_EQ(companions.with(1), (Ids{1, 3}));
  EXPECT_EQ(companions.with(2), (Ids{2}));
  companions.close_scope({4, 5}, {5});  // one left: no group
  EXPECT_EQ(companions.with(4), (Ids{4}));
}

TEST(BackwardCompanions, AParameterHeldInTwoScopesMergesTheirGroups) {
  BackwardCompanions companions;
  companions.close_scope({1, 2}, {});
  companions.close_scope({2, 6}, {});  // a parent reading its child's parameter
  for (int64_t id : {1, 2, 6}) EXPECT_EQ(companions.with(id), (Ids{1, 2, 6}));
  companions.close_scope({1, 2}, {});  // the next pass changes nothing
  EXPECT_EQ(companions.with(1), (Ids{1, 2, 6}));
  companions.close_scope({8, 2}, {});  // a new parameter read before a grouped one
  for (int64_t id : {1, 2, 6, 8}) EXPECT_EQ(companions.with(id), (Ids{1, 2, 6, 8}));
  companions.close_scope({9}, {});  // alone: no group
  EXPECT_EQ(companions.with(9), (Ids{9}));
}

}  // namespace
}  // namespace sharc
