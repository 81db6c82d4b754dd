#include "sharc/core/collective_cost.h"

#include <gtest/gtest.h>

#include "sharc/core/error.h"

namespace sharc {
namespace {

TEST(CollectiveCost, FitsLatencyAndBandwidthExactly) {
  // 50 us + 1 us per KiB
  const CollectiveCost c =
      CollectiveCost::fit({{1024, 51.0}, {4096, 54.0}, {65536, 114.0}, {1 << 20, 1074.0}});
  EXPECT_NEAR(c.latency_us, 50.0, 1e-6);
  EXPECT_NEAR(c.us_per_byte, 1.0 / 1024, 1e-9);
  EXPECT_NEAR(c.time_us(2048), 52.0, 1e-6);
}

TEST(CollectiveCost, OneSizeIsAllLatency) {
  const CollectiveCost c = CollectiveCost::fit({{4096, 10.0}, {4096, 30.0}});
  EXPECT_DOUBLE_EQ(c.latency_us, 20.0);
  EXPECT_DOUBLE_EQ(c.us_per_byte, 0.0);
}

TEST(CollectiveCost, ClampsNegativeSlopeAndIntercept) {
  // Larger came out faster (noise): no negative bandwidth term.
  const CollectiveCost falling = CollectiveCost::fit({{0, 100.0}, {1000, 50.0}});
  EXPECT_DOUBLE_EQ(falling.us_per_byte, 0.0);
  EXPECT_GE(falling.latency_us, 0.0);
  // A steep line through small times would give a negative latency.
  const CollectiveCost steep = CollectiveCost::fit({{1000, 1.0}, {2000, 100.0}});
  EXPECT_DOUBLE_EQ(steep.latency_us, 0.0);
  EXPECT_GT(steep.us_per_byte, 0.0);
}

TEST(CollectiveCost, RejectsBadSamples) {
  EXPECT_THROW(CollectiveCost::fit({}), Error);
  EXPECT_THROW(CollectiveCost::fit({{-1, 2.0}}), Error);
  EXPECT_THROW(CollectiveCost::fit({{1, -2.0}}), Error);
}

}  // namespace
TEST(InterHostBytes, FlatSendsGathersAndReductionsHybridOnlyTheAllReduce) {
  const int64_t p = 1 << 20;
  // 2 hosts x 2: two ring gathers of 3/4 p each, an all-to-all of 2 x 2/4 p.
  EXPECT_EQ(inter_host_bytes_per_step(p, 2, 2, false), p * 3 / 2 + p);
  // Hybrid: each rank all-reduces its half over 2 hosts, sending it once.
  EXPECT_EQ(inter_host_bytes_per_step(p, 2, 2, true), p);
  EXPECT_EQ(inter_host_bytes_per_step(p, 1, 4, false), 0);  // one host: nothing crosses
  // More ranks per host: flat grows towards 3 p, hybrid stays at p.
  EXPECT_GT(inter_host_bytes_per_step(p, 2, 8, false), inter_host_bytes_per_step(p, 2, 2, false));
  EXPECT_EQ(inter_host_bytes_per_step(p, 2, 8, true), p);
  EXPECT_THROW(inter_host_bytes_per_step(p, 0, 2, true), Error);
  EXPECT_DOUBLE_EQ(predict_step_us(1000.0, 25'000'000, 200e6), 1000.0 + 1e6);
}

}  // namespace sharc
