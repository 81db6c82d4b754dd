#include <gtest/gtest.h>

#include "sharc/core/graph_sequence.h"

namespace sharc {
namespace {

constexpr int64_t kForward = 0, kBackward = 1;
const GatherBucket kFirstOfB{{4, 5}, 6};
const GatherBucket kFirstOfC{{8}, 6};
const GraphSequence::Graph kA{kForward, {1, 2}};
const GraphSequence::Graph kB{kForward, {7}};

// One forward pass: graph A (ending with a gather of 1 and 2), eager code,
// graph B (starting with a gather of 4 and 5).
void forward_pass(GraphSequence& seq) {
  seq.graph_gathers(kForward, {{1, 2}, 6});
  EXPECT_FALSE(seq.end_graph(kA));
  if (auto ahead = seq.follower_to_start()) seq.started_ahead(*ahead);
  EXPECT_FALSE(seq.graph_gathers(kForward, kFirstOfB));
  EXPECT_FALSE(seq.end_graph(kB));
}

TEST(GraphSequence, TheFirstPassRecordsTheSecondPrefetches) {
  GraphSequence seq;
  EXPECT_FALSE(seq.follower_to_start());
  forward_pass(seq);
  seq.graph_gathers(kForward, {{1, 2}, 6});
  seq.end_graph(kA);
  ASSERT_TRUE(seq.follower_to_start());
  EXPECT_EQ(*seq.follower_to_start(), kFirstOfB);
  seq.started_ahead(*seq.follower_to_start());
  EXPECT_FALSE(seq.follower_to_start());  // once per end
  EXPECT_FALSE(seq.end_graph(kA));        // A's second prefetch point
  EXPECT_FALSE(seq.follower_to_start());
  EXPECT_FALSE(seq.graph_gathers(kForward, kFirstOfB));  // taken
  EXPECT_FALSE(seq.end_graph(kB));  // nothing left to give up
}

TEST(GraphSequence, AnEndNotFollowedByAGatherOfItsKindRecordsNothing) {
  GraphSequence seq;
  seq.end_graph(kA);
  seq.graph_gathers(kBackward, kFirstOfB);  // the backward begins
  seq.end_graph(kA);
  EXPECT_FALSE(seq.follower_to_start());
}

TEST(GraphSequence, APrefetchNotTakenIsGivenUpWhenTheNextGraphEnds) {
  GraphSequence seq;
  forward_pass(seq);
  seq.graph_gathers(kForward, {{1, 2}, 6});
  seq.end_graph(kA);
  seq.started_ahead(*seq.follower_to_start());
  // Another path: graph C follows A this time; it may still read B's
  // bucket, so it is kept until C ends.
  EXPECT_FALSE(seq.graph_gathers(kForward, kFirstOfC));
  const std::optional<GatherBucket> stale = seq.end_graph({kForward, {9}});
  ASSERT_TRUE(stale);
  EXPECT_EQ(*stale, kFirstOfB);
  // And C is A's follower from now on.
  seq.end_graph(kA);
  EXPECT_EQ(*seq.follower_to_start(), kFirstOfC);
}

TEST(GraphSequence, APrefetchIsGivenUpWhenTheOtherKindBegins) {
  GraphSequence seq;
  forward_pass(seq);
  seq.graph_gathers(kForward, {{1, 2}, 6});
  seq.end_graph(kA);
  seq.started_ahead(*seq.follower_to_start());
  const std::optional<GatherBucket> stale = seq.graph_gathers(kBackward, {{3}, 6});
  ASSERT_TRUE(stale);
  EXPECT_EQ(*stale, kFirstOfB);
}

TEST(GraphSequence, APrefetchIsGivenUpBeforeAGatherOfItsParametersInAnotherBucket) {
  GraphSequence seq;
  forward_pass(seq);
  seq.graph_gathers(kForward, {{1, 2}, 6});
  seq.end_graph(kA);
  seq.started_ahead(*seq.follower_to_start());
  const std::optional<GatherBucket> stale = seq.graph_gathers(kForward, {{4, 5}, 15});
  ASSERT_TRUE(stale);  // the same parameters in another dtype
  EXPECT_EQ(*stale, kFirstOfB);
}

TEST(GraphSequence, TheEndOfABackwardPassGivesUpItsPrefetchAndItsLastEnd) {
  GraphSequence seq;
  const GraphSequence::Graph b2{kBackward, {9}}, b1{kBackward, {8}};
  seq.graph_gathers(kBackward, {{9}, 6});
  seq.end_graph(b2);
  seq.graph_gathers(kBackward, {{8}, 6});
  seq.end_graph(b1);
  EXPECT_FALSE(seq.end_pass(kBackward));  // nothing ahead in the first pass
  // The next pass's first gather is no follower of the last pass's end.
  seq.graph_gathers(kBackward, {{9}, 6});
  seq.end_graph(b2);
  seq.started_ahead(*seq.follower_to_start());
  ASSERT_TRUE(seq.ahead());
  EXPECT_EQ(*seq.ahead(), (GatherBucket{{8}, 6}));
  const std::optional<GatherBucket> stale = seq.end_pass(kBackward);
  ASSERT_TRUE(stale);
  EXPECT_FALSE(seq.ahead());
  seq.end_graph(b1);
  EXPECT_FALSE(seq.follower_to_start());
}

TEST(GraphSequence, AGivenUpPrefetchIsForgotten) {
  GraphSequence seq;
  forward_pass(seq);
  seq.graph_gathers(kForward, {{1, 2}, 6});
  seq.end_graph(kA);
  seq.started_ahead(*seq.follower_to_start());
  seq.give_up_ahead();
  EXPECT_FALSE(seq.ahead());
  EXPECT_FALSE(seq.end_pass(kForward));
}

TEST(GraphSequence, AGraphRunTwiceInARowFollowsItself) {
  GraphSequence seq;
  const GatherBucket first{{1}, 6};
  const GraphSequence::Graph loop{kForward, {2}};
  for (int i = 0; i < 2; ++i) {
    seq.graph_gathers(kForward, first);
    seq.end_graph(loop);
  }
  ASSERT_TRUE(seq.follower_to_start());
  EXPECT_EQ(*seq.follower_to_start(), first);
}

}  // namespace
}  // namespace sharc
