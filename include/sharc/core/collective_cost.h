#pragma once
// The time one collective takes as a function of its size: a fixed latency
// plus bytes over bandwidth, fitted from a few measured sizes.
//
// Bytes are those of the full tensor the collective serves: an all-gather's
// output (the gathered parameters), a reduce-scatter's input (the full
// gradients). Times are in microseconds.

#include <cstdint>
#include <utility>
#include <vector>

namespace sharc {

struct CollectiveCost {
  double latency_us = 0.0;    ///< time of a collective of 0 bytes
  double us_per_byte = 0.0;   ///< time per byte beyond the latency

  /// Predicted time of one collective serving `bytes`.
  double time_us(int64_t bytes) const;

  /// Least-squares fit of latency + bytes * us_per_byte to (bytes, µs)
  /// samples, both clamped at 0 (a measured size may come out faster than
  /// a smaller one). Throws sharc::Error on fewer than one sample or a
  /// negative size or time.
  static CollectiveCost fit(const std::vector<std::pair<int64_t, double>>& samples);
};

}  // namespace sharc
