#include <gtest/gtest.h>

#include "sharc/core/accounting.h"
#include "sharc/core/error.h"

namespace sharc {
namespace {

TEST(MemoryAccounting, TracksGatheredAndPeak) {
  MemoryAccounting a;
  a.add_shard(100);
  a.on_gathered(400);
  a.on_gathered(200);
  EXPECT_EQ(a.stats().gathered_bytes, 600);
  a.on_freed(400);
  a.on_gathered(100);
  EXPECT_EQ(a.stats().gathered_bytes, 300);
  EXPECT_EQ(a.stats().peak_gathered_bytes, 600);
  EXPECT_EQ(a.stats().shard_bytes, 100);
}

TEST(MemoryAccounting, RemovesARetiredShardButNeverBelowZero) {
  MemoryAccounting a;
  a.add_shard(100);
  a.add_shard(60);
  a.remove_shard(100);
  EXPECT_EQ(a.stats().shard_bytes, 60);
  EXPECT_THROW(a.remove_shard(61), Error);
  EXPECT_THROW(a.remove_shard(-1), Error);
  EXPECT_EQ(a.stats().shard_bytes, 60);
}

TEST(MemoryAccounting, ResetKeepsLiveBytesAndClearsCounters) {
  MemoryAccounting a;
  a.on_gathered(500);
  a.on_freed(300);
  a.on_allgather_sent(64);
  a.on_reduce_scatter_sent(32);
  a.reset();
  EXPECT_EQ(a.stats().gathered_bytes, 200);
  EXPECT_EQ(a.stats().peak_gathered_bytes, 200);
  EXPECT_EQ(a.stats().allgather_bytes, 0);
  EXPECT_EQ(a.stats().reduce_scatter_bytes, 0);
  EXPECT_EQ(a.stats().allgather_calls, 0);
}

TEST(MemoryAccounting, CountsCommunication) {
  MemoryAccounting a;
  a.on_allgather_sent(10);
  a.on_allgather_sent(20);
  a.on_reduce_scatter_sent(5);
  EXPECT_EQ(a.stats().allgather_bytes, 30);
  EXPECT_EQ(a.stats().allgather_calls, 2);
  EXPECT_EQ(a.stats().reduce_scatter_bytes, 5);
  EXPECT_EQ(a.stats().reduce_scatter_calls, 1);
}

TEST(MemoryAccounting, CountsLateReductionsUntilReset) {
  MemoryAccounting a;
  a.on_late_reduction();
  a.on_late_reduction();
  a.on_late_grad_in_place();
  EXPECT_EQ(a.stats().late_reductions, 2);
  EXPECT_EQ(a.stats().late_grads_in_place, 1);
  a.reset();
  EXPECT_EQ(a.stats().late_reductions, 0);
  EXPECT_EQ(a.stats().late_grads_in_place, 0);
}

TEST(MemoryAccounting, FreeingMoreThanGatheredIsAnError) {
  MemoryAccounting a;
  a.on_gathered(10);
  EXPECT_THROW(a.on_freed(11), Error);
  EXPECT_THROW(a.on_gathered(-1), Error);
  EXPECT_THROW(a.add_shard(-1), Error);
}

}  // namespace
}  // namespace sharc
