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

/// Across hosts (docs/design/hybrid-sharding.md): the bytes one host sends
/// over its link to the others in one training step of a model of
/// `param_bytes` (what is gathered and reduced), on `hosts` hosts of
/// `per_host` ranks, with the collectives sharc issues on gloo: all-gathers
/// as a ring over the ranks in rank order (each host sends on one link
/// between hosts (W-1)/W of the bytes per gather; two gathers a step, forward
/// and backward), reduce-scatters as an all-to-all (each of a host's ranks
/// sends (W-M)/W of the gradient to the other hosts), and, hybrid, only the
/// replicate all-reduce of each rank's 1/M shard sums as a ring over the
/// hosts (2 (H-1)/H of them per rank).
int64_t inter_host_bytes_per_step(int64_t param_bytes, int64_t hosts, int64_t per_host,
                                  bool hybrid);

/// A step's predicted time when the link between hosts is the bottleneck:
/// `compute_us` (the step with that link unlimited) plus the host's bytes
/// over the link at `link_bits_per_s`, not overlapped (an upper bound where
/// backward hides part of the communication).
double predict_step_us(double compute_us, int64_t inter_host_bytes, double link_bits_per_s);

}  // namespace sharc
