"""What a user asks of a sharded model's runtime after shard(): gradient
accumulation without reduction (no_sync) and the per-rank byte figures."""

from __future__ import annotations

import contextlib

import torch

from sharc import _mesh
from sharc._library import Runtime
from sharc._retired import DEAD_SHARDS
from sharc._state import sharded_root


def _runtime(group) -> Runtime:
    return Runtime.for_group(group.group_name)


@contextlib.contextmanager
def no_sync(module: torch.nn.Module, enabled: bool = True, *, replicate_only: bool = False):
    """Backward passes inside skip the gradient reduce-scatter: each full
    gradient is summed into a full-size buffer of its parameter's (counted in
    memory_stats()['unreduced_grad_bytes']), and the first backward outside
    reduces the sum once. For gradient accumulation over N micro-batches:
    1/N of the reduce-scatter traffic, for one full-size gradient per
    parameter held between micro-batches. Every rank must use it alike.
    It is the setting of `module`'s process group (its runtime's): another
    model sharded over the same group whose backward runs inside is held
    back too, so run such backward passes outside it.
    A parameter the synced backward does not reach (used by an earlier
    micro-batch only) has what it held reduced at that backward's end (a
    synced backward that reduces any gradient at all).

    Hybrid sharding: `no_sync` defers both the reduce-scatter and the
    replicate all-reduce. With `replicate_only=True` only the all-reduce
    over the replicate group (the slow link between hosts) is deferred:
    each micro-batch is reduce-scattered within its shard group and the
    shard gradient sums wait in a shard-sized buffer per parameter
    (memory_stats()['unreplicated_grad_bytes']) until the first backward
    outside all-reduces them once. On flat sharding it defers nothing."""
    if not isinstance(replicate_only, bool):
        raise TypeError(f"sharc.no_sync(): replicate_only must be a bool, got {replicate_only!r}")
    runtime = sharded_root(module).runtime
    setter = runtime.set_replicate_sync if replicate_only else runtime.set_gradient_sync
    if enabled:
        setter(False)
    try:
        yield
    finally:
        if enabled:
            setter(True)


def memory_stats(group=None) -> dict[str, int]:
    """This rank's exact byte figures for `group` (default: the world):
    shard_bytes, gathered_bytes, peak_gathered_bytes, allgather_bytes,
    reduce_scatter_bytes (sent since the last reset), collective counts,
    kept_gathered_bytes (of gathered_bytes, what stays gathered by design:
    persistent parameters, and tied parameters an eager forward kept for
    their backward), unreduced_grad_bytes (full gradients held back by
    no_sync),
    graph_prefetch_calls (gathers compiled graphs started for the next one)
    and late_reductions (reductions compiled backward graphs on the host
    left in flight, their gradients added into .grad later; see
    docs/design/compiled-schedule.md) with late_grads_in_place (of those
    shard gradients, the ones written straight into a .grad that was the
    zeros the graph returned, instead of added), and the
    collective headers by which the ranks agree on every collective:
    header_bytes (room for them in the gathered buffers, beyond
    gathered_bytes), header_sent_bytes (since the last reset) and
    agreement_calls (collectives beyond the schedule's own it took to agree:
    none once the ranks have run a schedule before, see
    docs/design/collective-agreement.md).

    Hybrid sharding (pass the mesh, or the shard group): the figures above
    are the shard group's (shards over the shard group, reduce-scatter
    bytes sent in it); all_reduce_bytes and all_reduce_calls count the
    replicate group's all-reduces (bytes a ring all-reduce sends from each
    rank: 2 (R-1)/R of the payload, exact for R = 2), all_reduce_header_bytes
    their headers, replicate_size is R, and unreplicated_grad_bytes the shard
    sums held back by no_sync(replicate_only=True).

    A deleted model's bytes leave these figures (and memory) once its
    shards die, that is once the model, its optimizer and any autograd
    graph that reads them are gone (`del model, opt; gc.collect()`)."""
    group = _mesh.shard_group_of(group, "sharc")
    DEAD_SHARDS.retire()
    return dict(_runtime(group).stats())


def reset_memory_stats(group=None) -> None:
    """Zeroes the communication counters and resets the peak to the bytes
    gathered now."""
    group = _mesh.shard_group_of(group, "sharc")
    _runtime(group).reset_stats()
