#pragma once
// sharc's scheduling passes; each lives in its own file under src/passes/.

#include <cstdint>
#include <memory>

#include "sharc/pass.h"

namespace sharc::ir {

/// Backward graphs: every input that is a full parameter saved by forward
/// becomes a direct read of the parameter (so insertion gathers it again from
/// the shard); forward graphs: full parameters are dropped from the outputs.
/// Establishes: no saved full parameters.
std::unique_ptr<Pass> make_regather_in_backward();

/// Every directly read parameter gets `gather` and `wait` right before its
/// first use and `release` right after its last use (counted over all uses),
/// the release depending on the last user's outputs.
/// Establishes: no direct parameter reads.
std::unique_ptr<Pass> make_insert_gather_release();

/// Fuses consecutive gathers (in program order, compute in between allowed)
/// into one collective and one wait while their parameters total at most
/// `bucket_bytes`: later gathers move up to the bucket's first position, so
/// the bucket size bounds the extra bytes this prefetching keeps alive.
std::unique_ptr<Pass> make_bucket_allgathers(int64_t bucket_bytes);

/// Moves each gather up to right after the previous wait, so its collective
/// runs while the compute before its own wait does (one bucket ahead).
std::unique_ptr<Pass> make_prefetch_gathers();

/// One reduce_scatter per gradient, consecutive gradients bucketed up to
/// `bucket_bytes` (a larger gradient goes alone); each bucket is placed right
/// after the producer of its last gradient.
/// Establishes: every gradient reduced exactly once.
std::unique_ptr<Pass> make_insert_reduce_scatter(int64_t bucket_bytes);

}  // namespace sharc::ir
