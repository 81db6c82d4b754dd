#pragma once
// sharc's scheduling passes; each lives in its own file under src/compiler/passes/.
// Each documents its contract (Pass::contract): the rules it requires,
// establishes and undoes.

#include <cstdint>
#include <memory>

#include "sharc/compiler/pass.h"

namespace sharc::ir {

/// Backward graphs: every input that is a full parameter saved by forward
/// becomes a direct read of the parameter (so insertion gathers it again from
/// the shard); forward graphs: full parameters are dropped from the outputs.
/// A safety net: the bridge tags gathers for recompute, so its graphs never
/// carry a full parameter from forward to backward and this pass rewrites
/// nothing; it matters for a graph whose partitioner saved one.
/// Establishes: no saved full parameters.
std::unique_ptr<Pass> make_regather_in_backward();

/// Every directly read parameter gets `gather` and `wait` right before its
/// first use and `release` right after its last use (counted over all uses),
/// the release depending on the last user's outputs.
/// Establishes: gathers inserted; each wait right after its gather.
std::unique_ptr<Pass> make_insert_gather_release();

/// Fuses consecutive gathers (in program order, compute in between allowed)
/// into one collective and one wait while their parameters total at most
/// `bucket_bytes`: later gathers move up to the bucket's first position, so
/// the bucket size bounds the extra bytes this prefetching keeps alive.
/// Requires: each wait right after its gather (only such pairs are fused).
std::unique_ptr<Pass> make_bucket_allgathers(int64_t bucket_bytes);

/// Moves each gather up to right after the previous wait, so its collective
/// runs while the compute before its own wait does (one bucket ahead).
/// Requires: gathers inserted. Undoes: each wait right after its gather.
std::unique_ptr<Pass> make_prefetch_gathers();

/// One reduce_scatter per gradient, consecutive gradients bucketed up to
/// `bucket_bytes` (a larger gradient goes alone); each bucket is placed right
/// after the producer of its last gradient.
/// Establishes: gradients reduced (each exactly once).
std::unique_ptr<Pass> make_insert_reduce_scatter(int64_t bucket_bytes);

}  // namespace sharc::ir
