#include <gtest/gtest.h>

#include "sharc/core/gather_order.h"

namespace sharc {
namespace {

using Buckets = std::vector<GatherBucket>;
using Ids = std::vector<int64_t>;

constexpr int64_t kOwn = GatherBucket::kOwnDtype;

GatherBucket own(Ids ids) { return GatherBucket{std::move(ids), kOwn}; }

// What a run of events asked the runtime to start and to give up.
struct Log {
  Buckets started;
  Ids given_up;
  void add(const GatherOrder::Decision& d) {
    started.insert(started.end(), d.start.begin(), d.start.end());
    given_up.insert(given_up.end(), d.give_up.begin(), d.give_up.end());
  }
};

// Eager code reads `id` inside module `module`: a gather the code asks for,
// and the point right after it.
void read(GatherOrder& order, int64_t module, int64_t id, Log* log = nullptr) {
  Log ignored;
  Log& to = log ? *log : ignored;
  to.add(order.gather(module, own({id})));
  to.add(order.reached({id}));
}

// A forward of three modules: module 10 reads 0 and 1, module 11 reads 2,
// module 12 reads 3 and 4.
void three_modules(GatherOrder& order, Log* log = nullptr) {
  const std::vector<std::pair<int64_t, int64_t>> reads{{10, 0}, {10, 1}, {11, 2}, {12, 3}, {12, 4}};
  for (auto [module, id] : reads) read(order, module, id, log);
}

TEST(GatherOrder, TheFirstPassRecordsTheNextStartsAStepAndTheOneAfter) {
  GatherOrder order;
  Log log;
  three_modules(order, &log);
  EXPECT_TRUE(log.started.empty());
  EXPECT_TRUE(order.end_pass().empty());
  three_modules(order, &log);
  // 0's step (with 0, one collective) and the next at the first read; 2's
  // step was started, so the point after 2 starts only the step after it.
  EXPECT_EQ(log.started, (Buckets{own({0, 1}), own({2}), own({3, 4})}));
  EXPECT_TRUE(log.given_up.empty());
  EXPECT_TRUE(order.end_pass().empty());  // every parameter was taken
}

TEST(GatherOrder, StepsAreKnownByTheLastFinishedPass) {
  GatherOrder order;
  EXPECT_EQ(order.step_of(2), -1);
  three_modules(order);
  EXPECT_EQ(order.step_of(2), -1);  // not finished yet
  order.end_pass();
  EXPECT_EQ(order.step_of(0), 0);
  EXPECT_EQ(order.step_of(2), 1);
  EXPECT_EQ(order.step_of(4), 2);
}

TEST(GatherOrder, ExcludedParametersAreNeitherRecordedNorAPoint) {
  GatherOrder order;
  order.exclude(2);
  EXPECT_TRUE(order.gather(10, own({0})).start.empty());
  EXPECT_TRUE(order.gather(11, own({2})).start.empty());
  EXPECT_TRUE(order.gather(12, own({3})).start.empty());
  order.end_pass();
  EXPECT_EQ(order.step_of(0), 0);
  EXPECT_EQ(order.step_of(2), -1);
  EXPECT_EQ(order.step_of(3), 1);
  // Only some ranks read a gather unit's member: reading it moves nothing
  // and gives up nothing, or the ranks' next collectives would differ.
  Log log;
  read(order, 20, 0, &log);
  EXPECT_EQ(log.started, (Buckets{own({3})}));
  read(order, 21, 2, &log);
  EXPECT_EQ(log.started.size(), 1u);
  EXPECT_TRUE(log.given_up.empty());
  EXPECT_EQ(order.ahead(), (Ids{3}));
}

TEST(GatherOrder, APassThatGatheredNothingKeepsTheOldOrder) {
  GatherOrder order;
  three_modules(order);
  order.end_pass();
  EXPECT_TRUE(order.end_pass().empty());
  EXPECT_EQ(order.step_of(3), 2);
}

TEST(GatherOrder, AnotherPathThisTimeBecomesTheOrderAndTheEndGivesUpWhatNobodyTook) {
  GatherOrder order;
  three_modules(order);
  order.end_pass();
  // Module 12 reads 3 only: its step is started, and 4 never taken. 0 and
  // 1 were never started, so the end gives up nothing of theirs.
  Log log;
  read(order, 12, 3, &log);
  EXPECT_EQ(log.started, (Buckets{own({3, 4})}));
  EXPECT_EQ(order.end_pass(), (Ids{4}));
  EXPECT_TRUE(order.ahead().empty());
  EXPECT_EQ(order.step_of(3), 0);
  EXPECT_EQ(order.step_of(0), -1);
}

TEST(GatherOrder, AParentReadingAfterItsChildGivesUpNothingItsPointsStarted) {
  // Module 1 reads 10, its child 2 reads 20, module 1 reads 11, module 3
  // reads 30: module 1's step holds 10 and 11.
  const std::vector<std::pair<int64_t, int64_t>> reads{{1, 10}, {2, 20}, {1, 11}, {3, 30}};
  GatherOrder order;
  for (auto [module, id] : reads) read(order, module, id);
  order.end_pass();
  Log log;
  for (auto [module, id] : reads) read(order, module + 100, id, &log);
  EXPECT_EQ(log.started, (Buckets{own({10, 11}), own({20}), own({30})}));
  EXPECT_TRUE(log.given_up.empty());  // 30, started after 20, was still to come
  EXPECT_TRUE(order.end_pass().empty());
}

TEST(GatherOrder, ATiedParameterReadAgainLaterIsFoundInItsLaterStep) {
  // Module 10 reads 0, module 11 reads 1, module 12 reads 0 again and 2.
  const std::vector<std::pair<int64_t, int64_t>> reads{{10, 0}, {11, 1}, {12, 0}, {12, 2}};
  GatherOrder order;
  for (auto [module, id] : reads) read(order, module, id);
  order.end_pass();
  EXPECT_EQ(order.step_of(0), 0);  // its first step
  Log log;
  for (auto [module, id] : reads) read(order, module, id, &log);
  // 0 alone is its whole step: nothing to start but the step after it.
  EXPECT_EQ(log.started, (Buckets{own({1}), own({0, 2})}));
  EXPECT_TRUE(log.given_up.empty());
  EXPECT_TRUE(order.end_pass().empty());
}

TEST(GatherOrder, AGatherTheOrderHasNotSeenGivesUpWhatAnEarlierPointStarted) {
  GatherOrder order;
  three_modules(order);
  order.end_pass();
  Log log;
  read(order, 10, 0, &log);  // starts {0, 1} and {2}
  read(order, 10, 1, &log);
  read(order, 13, 7, &log);  // a module the last pass did not run
  EXPECT_EQ(log.given_up, (Ids{2}));
  EXPECT_TRUE(order.ahead().empty());
}

// Compiled graphs: each gather a step of its own (named by a count), a point
// at the end of each graph, found by the graph's key (its last gather's
// parameters); the gather itself starts nothing beyond what it asks for.
constexpr int64_t kDtype = 6;
const GatherBucket kLastOfA{{1, 2}, kDtype};
const GatherBucket kFirstOfB{{4, 5}, kDtype};
const GatherBucket kLastOfB{{7}, kDtype};
const GatherBucket kOnlyOfC{{8}, kDtype};

struct Graphs {
  GatherOrder order;
  int64_t gathers = 0;
  Log log;
  void gather(const GatherBucket& bucket) {
    log.add(order.gather(gathers++, bucket, [](const GatherBucket&) { return false; }));
  }
  void end(const Ids& key, bool room = true) {
    log.add(order.reached(key, [room](const GatherBucket&) { return room; }));
  }
  // One forward pass: graph A (one gather of 1 and 2), eager code, graph B
  // (a gather of 4 and 5, then one of 7).
  void forward_pass() {
    gather(kLastOfA);
    end(kLastOfA.ids);
    gather(kFirstOfB);
    gather(kLastOfB);
    end(kLastOfB.ids);
  }
  // A recorded forward pass, then the next one up to A's end, which starts
  // B's first bucket ahead.
  void next_pass_until_a_ends() {
    forward_pass();
    order.end_pass();
    gather(kLastOfA);
    end(kLastOfA.ids);
  }
};

TEST(GatherOrder, TheFirstGraphPassRecordsTheSecondPrefetchesOneBucketAhead) {
  Graphs g;
  g.forward_pass();
  EXPECT_TRUE(g.log.started.empty());
  EXPECT_TRUE(g.order.end_pass().empty());
  g.gather(kLastOfA);
  EXPECT_TRUE(g.log.started.empty());  // a graph's gather starts nothing more
  g.end(kLastOfA.ids);
  EXPECT_EQ(g.log.started, Buckets{kFirstOfB});
  g.end(kLastOfA.ids);  // A's second prefetch point: once a pass
  EXPECT_EQ(g.log.started.size(), 1u);
  g.gather(kFirstOfB);  // taken
  EXPECT_TRUE(g.order.ahead().empty());
  g.gather(kLastOfB);
  g.end(kLastOfB.ids);  // the pass's last step: nothing follows it
  EXPECT_EQ(g.log.started.size(), 1u);
  EXPECT_TRUE(g.log.given_up.empty());
  EXPECT_TRUE(g.order.end_pass().empty());
}

TEST(GatherOrder, ABucketThatDoesNotFitIsTriedAgainAtTheGraphsNextPoint) {
  Graphs g;
  g.forward_pass();
  g.order.end_pass();
  g.gather(kLastOfA);
  g.end(kLastOfA.ids, /*room=*/false);
  EXPECT_TRUE(g.log.started.empty());
  g.end(kLastOfA.ids);
  EXPECT_EQ(g.log.started, Buckets{kFirstOfB});
}

TEST(GatherOrder, APrefetchNotTakenIsGivenUpWhenTheNextGraphEnds) {
  Graphs g;
  g.next_pass_until_a_ends();
  // Another path: graph C follows A this time; it may still read B's
  // bucket, so it is kept until C ends.
  g.gather(kOnlyOfC);
  EXPECT_TRUE(g.log.given_up.empty());
  g.end(kOnlyOfC.ids);
  EXPECT_EQ(g.log.given_up, kFirstOfB.ids);
  EXPECT_TRUE(g.order.end_pass().empty());
  // And C follows A from now on.
  g.gather(kLastOfA);
  g.end(kLastOfA.ids);
  EXPECT_EQ(g.log.started.back(), kOnlyOfC);
}

TEST(GatherOrder, APrefetchIsGivenUpBeforeAGatherOfItsParametersInAnotherDtype) {
  Graphs g;
  g.next_pass_until_a_ends();
  g.gather(GatherBucket{{4, 5}, 15});
  EXPECT_EQ(g.log.given_up, kFirstOfB.ids);
  EXPECT_TRUE(g.order.ahead().empty());
}

TEST(GatherOrder, GivingUpWhatIsAheadForgetsIt) {
  Graphs g;
  g.next_pass_until_a_ends();
  EXPECT_EQ(g.order.ahead(), kFirstOfB.ids);
  EXPECT_EQ(g.order.give_up_ahead(), kFirstOfB.ids);  // the other kind of pass began
  EXPECT_TRUE(g.order.ahead().empty());
  EXPECT_TRUE(g.order.end_pass().empty());
}

TEST(GatherOrder, TheEndOfAPassGivesUpItsPrefetchAndThatPassIsFollowedNext) {
  Graphs g;
  const GatherBucket b2{{9}, kDtype}, b1{{8}, kDtype};
  g.gather(b2);
  g.end(b2.ids);
  g.gather(b1);
  g.end(b1.ids);
  EXPECT_TRUE(g.order.end_pass().empty());  // nothing ahead in the first pass
  g.gather(b2);
  g.end(b2.ids);
  EXPECT_EQ(g.log.started, Buckets{b1});
  EXPECT_EQ(g.order.end_pass(), b1.ids);  // b1 never came
  EXPECT_TRUE(g.order.ahead().empty());
  // The pass that ended after b2 is the order now: nothing follows b2.
  g.gather(b2);
  g.end(b2.ids);
  EXPECT_EQ(g.log.started.size(), 1u);
}

TEST(GatherOrder, AGatherIsFoundInTheRecordedStepNearestWhereThePassIs) {
  // Graphs X, Y, X again, Z; this pass skips the first X.
  Graphs g;
  const GatherBucket x{{1}, kDtype}, y{{2}, kDtype}, z{{3}, kDtype};
  for (const GatherBucket& graph : {x, y, x, z}) {
    g.gather(graph);
    g.end(graph.ids);
  }
  g.order.end_pass();
  g.gather(y);
  g.end(y.ids);
  EXPECT_EQ(g.log.started, Buckets{x});
  g.gather(x);  // the X after Y, not the first one
  g.end(x.ids);
  EXPECT_EQ(g.log.started, (Buckets{x, z}));
  EXPECT_TRUE(g.log.given_up.empty());
}

TEST(GatherOrder, AGraphRunTwiceInARowFollowsItself) {
  Graphs g;
  const GatherBucket only{{1}, kDtype};
  for (int i = 0; i < 2; ++i) {
    g.gather(only);
    g.end(only.ids);
  }
  g.order.end_pass();
  g.gather(only);
  g.end(only.ids);
  EXPECT_EQ(g.log.started, Buckets{only});  // its second run
  g.gather(only);  // the second run takes it, and nothing follows that run
  g.end(only.ids);
  EXPECT_EQ(g.log.started.size(), 1u);
  EXPECT_TRUE(g.order.end_pass().empty());
}

// Graphs whose points start ahead while `room` lets each bucket (the
// compiled graphs' window): three graphs of one gather each.
struct Window {
  GatherOrder order;
  int64_t gathers = 0;
  Log log;
  int room = 1 << 20;  // buckets the next point may start
  const GatherBucket a{{1}, kDtype}, b{{2, 3}, kDtype}, c{{4}, kDtype}, d{{5}, kDtype};
  void gather(const GatherBucket& bucket) {
    log.add(order.gather(gathers++, bucket, [](const GatherBucket&) { return false; }));
  }
  void end(const Ids& key) {
    int left = room;
    log.add(order.reached(key, [&left](const GatherBucket&) { return left-- > 0; },
                          GatherOrder::Reach::kWhileFits));
  }
  void graph(const GatherBucket& bucket) {
    gather(bucket);
    end(bucket.ids);
  }
  void recorded_pass() {
    for (const GatherBucket* g : {&a, &b, &c, &d}) graph(*g);
    order.end_pass();
  }
};

TEST(GatherOrder, AWindowPointStartsEveryLaterStepThatFitsAndTheGraphsTakeThem) {
  Window w;
  w.recorded_pass();
  w.graph(w.a);
  EXPECT_EQ(w.log.started, (Buckets{w.b, w.c, w.d}));
  w.graph(w.b);
  w.graph(w.c);
  w.graph(w.d);
  EXPECT_EQ(w.log.started.size(), 3u);  // each started once a pass
  EXPECT_TRUE(w.log.given_up.empty());
  EXPECT_TRUE(w.order.end_pass().empty());
}

TEST(GatherOrder, AWindowStopsAtTheFirstStepThatDoesNotFitAndLaterPointsTopItUp) {
  Window w;
  w.recorded_pass();
  w.room = 2;
  w.graph(w.a);
  EXPECT_EQ(w.log.started, (Buckets{w.b, w.c}));
  w.room = 1;
  w.graph(w.b);  // c is under way: the window goes on with d
  EXPECT_EQ(w.log.started, (Buckets{w.b, w.c, w.d}));
}

TEST(GatherOrder, AStepAWindowStartedIsGivenUpOnceThePassGoesPastItsPlace) {
  Window w;
  w.recorded_pass();
  w.graph(w.a);  // starts b, c and d
  w.graph(w.c);  // another path: b did not come
  EXPECT_EQ(w.log.given_up, w.b.ids);
  w.graph(w.d);  // d came after c as recorded: taken, not given up
  EXPECT_EQ(w.log.given_up, w.b.ids);
  EXPECT_TRUE(w.order.end_pass().empty());
}

TEST(GatherOrder, TheNextStepOnlyReachStartsOneStep) {
  Graphs g;
  g.forward_pass();
  g.gather(kOnlyOfC);  // a third graph
  g.end(kOnlyOfC.ids);
  g.order.end_pass();
  g.gather(kLastOfA);
  g.end(kLastOfA.ids);
  EXPECT_EQ(g.log.started, Buckets{kFirstOfB});
}

}  // namespace
}  // namespace sharc
