#include <gtest/gtest.h>

#include "sharc/core/error.h"
#include "sharc/core/layout.h"

namespace sharc {
namespace {

TEST(ShardLayout, EvenSplit) {
  const auto l = ShardLayout::make(12, 4, 2);
  EXPECT_EQ(l.shard_numel(), 3);
  EXPECT_EQ(l.padded_numel(), 12);
  EXPECT_EQ(l.padding(), 0);
  EXPECT_EQ(l.shard_offset(), 6);
  EXPECT_EQ(l.valid_numel(), 3);
}

TEST(ShardLayout, UnevenSplitPadsTheLastRanks) {
  // 10 elements over 4 ranks: shards of 3, padded to 12, rank 3 holds 1 real.
  for (int64_t r = 0; r < 4; ++r) {
    const auto l = ShardLayout::make(10, 4, r);
    EXPECT_EQ(l.shard_numel(), 3);
    EXPECT_EQ(l.padded_numel(), 12);
    EXPECT_EQ(l.padding(), 2);
    EXPECT_EQ(l.shard_offset(), 3 * r);
  }
  EXPECT_EQ(ShardLayout::make(10, 4, 2).valid_numel(), 3);
  EXPECT_EQ(ShardLayout::make(10, 4, 3).valid_numel(), 1);
}

TEST(ShardLayout, FewerElementsThanRanks) {
  // 3 elements over 4 ranks: every shard holds 1, the last rank only padding.
  EXPECT_EQ(ShardLayout::make(3, 4, 0).shard_numel(), 1);
  EXPECT_EQ(ShardLayout::make(3, 4, 0).padded_numel(), 4);
  EXPECT_EQ(ShardLayout::make(3, 4, 2).valid_numel(), 1);
  EXPECT_EQ(ShardLayout::make(3, 4, 3).valid_numel(), 0);
}

TEST(ShardLayout, ZeroSizeParameter) {
  const auto l = ShardLayout::make(0, 4, 1);
  EXPECT_EQ(l.shard_numel(), 0);
  EXPECT_EQ(l.padded_numel(), 0);
  EXPECT_EQ(l.valid_numel(), 0);
  EXPECT_EQ(l.shard_offset(), 0);
}

TEST(ShardLayout, SingleRankOwnsEverything) {
  const auto l = ShardLayout::make(7, 1, 0);
  EXPECT_EQ(l.shard_numel(), 7);
  EXPECT_EQ(l.padding(), 0);
  EXPECT_EQ(l.valid_numel(), 7);
}

TEST(ShardLayout, ValidElementsSumToNumel) {
  for (int64_t world : {1, 2, 3, 4, 7, 8}) {
    for (int64_t n : {0, 1, 2, 5, 8, 9, 63, 64, 65, 1000}) {
      int64_t total = 0;
      for (int64_t r = 0; r < world; ++r) {
        const auto l = ShardLayout::make(n, world, r);
        EXPECT_EQ(l.padded_numel() % world, 0);
        EXPECT_LT(l.padding(), world);
        total += l.valid_numel();
      }
      EXPECT_EQ(total, n) << "n=" << n << " world=" << world;
    }
  }
}

TEST(ShardLayout, RejectsBadArguments) {
  EXPECT_THROW(ShardLayout::make(-1, 2, 0), Error);
  EXPECT_THROW(ShardLayout::make(4, 0, 0), Error);
  EXPECT_THROW(ShardLayout::make(4, 2, 2), Error);
  EXPECT_THROW(ShardLayout::make(4, 2, -1), Error);
}

}  // namespace
}  // namespace sharc
