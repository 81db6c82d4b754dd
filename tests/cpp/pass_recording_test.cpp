#include <gtest/gtest.h>

#include "sharc/core/pass_recording.h"

namespace sharc {
namespace {

using Groups = std::vector<std::vector<int64_t>>;

// A forward of three modules: module 10 reads 0 and 1, module 11 reads 2,
// module 12 reads 3 and 4.
void three_modules(PassRecording& pass, Groups* started = nullptr) {
  const std::vector<std::pair<int64_t, int64_t>> reads{{10, 0}, {10, 1}, {11, 2}, {12, 3}, {12, 4}};
  for (auto [key, id] : reads) {
    for (auto& group : pass.on_gather(key, id)) {
      if (started) started->push_back(group);
    }
  }
}

TEST(PassRecording, TheFirstPassRecordsTheNextStartsAGroupAndTheOneAfter) {
  PassRecording pass;
  Groups started;
  three_modules(pass, &started);
  EXPECT_TRUE(started.empty());
  EXPECT_TRUE(pass.finish().empty());
  three_modules(pass, &started);
  // 0's group and the next at the first read; 2's group was started, so
  // the read of 2 starts only the group after it; the read of 3 nothing.
  EXPECT_EQ(started, (Groups{{0, 1}, {2}, {3, 4}}));
  EXPECT_EQ(pass.finish(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(PassRecording, GroupsAreKnownByTheLastFinishedPass) {
  PassRecording pass;
  EXPECT_EQ(pass.group_of(2), -1);
  three_modules(pass);
  EXPECT_EQ(pass.group_of(2), -1);  // not finished yet
  pass.finish();
  EXPECT_EQ(pass.group_of(0), 0);
  EXPECT_EQ(pass.group_of(2), 1);
  EXPECT_EQ(pass.group_of(4), 2);
}

TEST(PassRecording, ARereadKeepsItsFirstGroupAndExcludedParametersMoveNothing) {
  PassRecording pass;
  pass.exclude(2);
  EXPECT_TRUE(pass.on_gather(10, 0).empty());
  EXPECT_TRUE(pass.on_gather(11, 2).empty());
  EXPECT_TRUE(pass.on_gather(12, 0).empty());  // a tied weight read again
  EXPECT_TRUE(pass.on_gather(12, 3).empty());
  pass.finish();
  EXPECT_EQ(pass.group_of(0), 0);
  EXPECT_EQ(pass.group_of(2), -1);
  EXPECT_EQ(pass.group_of(3), 1);
  EXPECT_EQ(pass.on_gather(11, 2), Groups{});
}

TEST(PassRecording, APassThatGatheredNothingKeepsTheOldOrder) {
  PassRecording pass;
  three_modules(pass);
  pass.finish();
  EXPECT_TRUE(pass.finish().empty());
  EXPECT_EQ(pass.group_of(3), 2);
}

TEST(PassRecording, AnotherPathThisTimeBecomesTheOrder) {
  PassRecording pass;
  three_modules(pass);
  pass.finish();
  // Module 12 only: its group and nothing after; 0 and 1 were never
  // started, so the end frees nothing of theirs.
  EXPECT_EQ(pass.on_gather(12, 3), (Groups{{3, 4}}));
  EXPECT_EQ(pass.finish(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(pass.group_of(3), 0);
  EXPECT_EQ(pass.group_of(0), -1);
}

}  // namespace
}  // namespace sharc
