#include "sharc/core/layout.h"

#include <algorithm>

#include "sharc/core/error.h"

namespace sharc {

ShardLayout ShardLayout::make(int64_t numel, int64_t world_size, int64_t rank) {
  SHARC_CHECK(numel >= 0, "a parameter cannot have ", numel, " elements");
  SHARC_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size);
  SHARC_CHECK(rank >= 0 && rank < world_size, "rank ", rank,
              " is outside the group of ", world_size, " ranks");
  return ShardLayout{numel, world_size, rank};
}

int64_t ShardLayout::shard_numel() const {
  return (numel + world_size - 1) / world_size;
}

int64_t ShardLayout::padded_numel() const { return world_size * shard_numel(); }

int64_t ShardLayout::padding() const { return padded_numel() - numel; }

int64_t ShardLayout::shard_offset() const { return rank * shard_numel(); }

int64_t ShardLayout::valid_numel() const {
  return std::clamp<int64_t>(numel - shard_offset(), 0, shard_numel());
}

}  // namespace sharc
