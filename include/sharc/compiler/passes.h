#pragma once
// sharc's scheduling passes; each lives in its own file under src/compiler/passes/.
// Each documents its contract (Pass::contract): the rules it requires,
// establishes and undoes.

#include <cstdint>
#include <memory>
#include <optional>
#include <set>

#include "sharc/compiler/memory.h"
#include "sharc/compiler/pass.h"
#include "sharc/compiler/timeline.h"
#include "sharc/core/collective_cost.h"

namespace sharc::ir {

/// Backward graphs: every input that is a full parameter saved by forward
/// becomes a direct read of the parameter (so insertion gathers it again from
/// the shard); forward graphs: full parameters are dropped from the outputs.
/// A safety net: the bridge tags gathers for recompute, so its graphs never
/// carry a full parameter from forward to backward and this pass rewrites
/// nothing; it matters for a graph whose partitioner saved one.
/// Establishes: no saved full parameters.
std::unique_ptr<Pass> make_regather_in_backward();

/// Mixed precision: a parameter (of known floating dtype) whose every read is
/// a compute node with `cast=D` converting it alone, one smaller floating
/// dtype D for all of them, is gathered in D: its declaration takes D and the
/// bytes of D (the runtime casts the shard, then gathers, so the collective
/// moves the small dtype), the casts go, and what read them reads the
/// parameter directly. A parameter with any other read (a full-precision
/// use, a view, a cast to another or a wider dtype, an output, a saved
/// `input param=`, a cast whose result is an output or a reduced gradient)
/// keeps its full-precision gather: that read needs the full value, and
/// gathering twice would cost more than it saves. Returns the casts removed.
/// It sees only direct reads (`@k` operands), which insert_gather_release
/// turns into gathered values, so it must run before that pass; its contract
/// says so (Contract::precedes) and the pass manager enforces it.
/// Precedes: gathers inserted.
std::unique_ptr<Pass> make_cast_before_gather();

/// Refuses a memory budget below the smallest this graph can run in: the
/// peak of its plain schedule (every parameter gathered alone right before
/// its first use, released right after its last; kept ones resident),
/// throwing sharc::Error that names that smallest budget. Rewrites nothing;
/// without a budget it does nothing.
/// Precedes: gathers inserted.
std::unique_ptr<Pass> make_check_memory_budget(std::optional<int64_t> budget_bytes);

/// Selective unsharding: marks `kept` parameters this graph reads, so they
/// stay gathered from forward to backward (no re-gather) and across steps
/// (gathered once per step, when their shard has changed). Greedy by the
/// all-gather time saved per byte kept (`gather_cost`), while the kept bytes
/// fit in half of what `budget_bytes` leaves above the plain schedule's
/// peak. Only `candidates` (IR ids) if given: the parameters the backward
/// reads again (keeping another saves nothing). Without a budget or a cost
/// it keeps nothing. Returns the number kept.
/// Precedes: gathers inserted.
std::unique_ptr<Pass> make_keep_gathered_params(
    std::optional<int64_t> budget_bytes, std::optional<CollectiveCost> gather_cost,
    std::optional<std::set<int64_t>> candidates = std::nullopt);

/// Every directly read parameter gets `gather` and `wait` right before its
/// first use and `release` right after its last use (counted over all uses),
/// the release depending on the last user's outputs.
/// Establishes: gathers inserted; each wait right after its gather.
std::unique_ptr<Pass> make_insert_gather_release();

/// Fuses consecutive gathers (in program order, compute in between allowed)
/// into one collective and one wait while their parameters total at most
/// `bucket_bytes` and have one dtype: later gathers move up to the bucket's
/// first position, so the bucket size bounds the extra bytes this
/// prefetching keeps alive. With a budget, the cap halves until the bucketed
/// schedule's peak fits it.
/// Requires: each wait right after its gather (only such pairs are fused).
std::unique_ptr<Pass> make_bucket_allgathers(int64_t bucket_bytes,
                                             std::optional<int64_t> budget_bytes = {});

/// Moves each gather up to right after the previous wait, so its collective
/// runs while the compute before its own wait does (one bucket ahead); with
/// a budget, only the moves that keep the schedule within it.
/// Requires: gathers inserted. Undoes: each wait right after its gather.
std::unique_ptr<Pass> make_prefetch_gathers(std::optional<int64_t> budget_bytes = {});

/// Moves each gather (in program order) up to where the predicted run
/// (timeline.h: measured compute costs, the group's collective costs) says
/// it must be issued to be done by its wait (or, while the channel is busy
/// with earlier collectives, to where the channel frees), so a gather may
/// run several compute-heavy stretches ahead of its use. Never above
/// another collective: compute costs are this rank's own, so they place
/// collectives among compute nodes only, while the order of the collectives
/// (which every rank must issue alike) stays as the passes before fixed it
/// from numbers every rank shares. Never above a release of one of its
/// parameters; with a budget, only as far as the schedule stays within it.
/// Without a gather cost or any compute cost it moves nothing.
/// Requires: gathers inserted; gradients reduced (so it sees every
/// collective). Undoes: each wait right after its gather.
std::unique_ptr<Pass> make_prefetch_by_cost(CollectiveCostModel costs,
                                            std::optional<int64_t> budget_bytes = {});

/// One reduce_scatter per gradient, consecutive gradients bucketed up to
/// `bucket_bytes` (a larger gradient goes alone); each bucket is placed right
/// after the producer of its last gradient, and defines a token naming the
/// reduction in flight (`%sharc_reduce_<first parameter>`). Where the
/// reductions are waited on is place_reduce_waits' job.
/// Establishes: gradients reduced (each exactly once).
std::unique_ptr<Pass> make_insert_reduce_scatter(int64_t bucket_bytes);

/// A wait_reduce for every reduction not waited on yet, placed right after
/// the next reduction starts (that one's collective then runs while backward
/// computes up to it; at most two are in flight), the last one right before
/// the output. Each wait defines its parameters' shard gradients
/// (`%sharc_shard_grad_<parameter>`), which the output then reads: they are
/// what leaves the graph. Returns the waits placed.
/// Requires: gradients reduced. Establishes: reductions waited.
std::unique_ptr<Pass> make_place_reduce_waits();

/// Hybrid sharding over `replicas` > 1 replicate groups: an all_reduce of
/// every reduction's token, placed where its wait_reduce was (right after
/// the next reduction starts), and that wait moved on to right after the
/// next all_reduce (the last one before the output), waiting on the
/// all_reduce's token. With `replicas` <= 1 (flat sharding) it does nothing.
/// Returns the all_reduces inserted.
/// Requires: reductions waited. Establishes: replicas reduced.
std::unique_ptr<Pass> make_insert_replicate_all_reduce(int64_t replicas);

/// Cross-graph prefetch: marks, with `prefetch_next` nodes, where the
/// runtime may start the next compiled graph's first gather: right after
/// the last wait (the tail computation then hides it) and right after the
/// last release (when the graph holds least), each naming the graph by its
/// last gather's parameters and carrying `budget_bytes` (-1 without one),
/// which the runtime holds that gather to. A graph without a gather gets
/// none. Returns the marks placed.
/// Requires: gathers inserted.
std::unique_ptr<Pass> make_mark_graph_prefetch(std::optional<int64_t> budget_bytes = {});

/// Sets each gather's and reduce_scatter's `cost=` to its collective's
/// predicted time (microseconds, from the measured costs; none unmeasured),
/// so a dumped schedule shows them. Returns the nodes annotated.
/// Requires: gathers inserted; gradients reduced.
std::unique_ptr<Pass> make_annotate_collective_costs(std::optional<CollectiveCost> gather_cost,
                                                     std::optional<CollectiveCost> reduce_cost);

}  // namespace sharc::ir
