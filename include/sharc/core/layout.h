#pragma once
// The padded flat layout of one sharded parameter.
//
// A parameter of n elements is flattened and padded to W * ceil(n / W)
// elements; rank r owns the contiguous slice [r * s, (r + 1) * s) with
// s = ceil(n / W). The padding lives at the end of the flat buffer, so the
// last ranks may own fewer real elements (or none, when n < W).

#include <cstdint>

namespace sharc {

struct ShardLayout {
  int64_t numel = 0;       ///< elements of the true (unsharded) parameter
  int64_t world_size = 1;  ///< ranks in the process group
  int64_t rank = 0;        ///< this rank

  /// Validates the arguments; throws sharc::Error on negative sizes or a rank
  /// outside [0, world_size).
  static ShardLayout make(int64_t numel, int64_t world_size, int64_t rank);

  /// Elements of every rank's shard: ceil(numel / world_size).
  int64_t shard_numel() const;
  /// Elements of the padded flat buffer: world_size * shard_numel().
  int64_t padded_numel() const;
  /// Padding elements at the end of the flat buffer.
  int64_t padding() const;
  /// Offset of this rank's shard inside the flat buffer.
  int64_t shard_offset() const;
  /// Real (non-padding) elements in this rank's shard, 0..shard_numel().
  int64_t valid_numel() const;
};

}  // namespace sharc
