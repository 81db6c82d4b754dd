"""Inductor lowerings for sharc's ops where Inductor's defaults are unsafe.

A `wait_gather` output is an alias of a runtime buffer whose storage
`release` frees in place. Inductor may hand a buffer whose last use has
passed to a later kernel's output (buffer reuse); for a released gathered
buffer that would write into freed storage. The lowering runs the op as the
usual fallback kernel and marks its outputs never to be reused.
`wait_reduce_scatter`'s outputs are marked likewise: where the wait is left
behind the graph they are zeros the runtime recognises by their storage, and
a gradient's local terms added in place into them would be overwritten by
the late delivery ([Note: local gradient terms] in merge_gradients.py).

It also repairs a scheduler bug of the Inductor versions sharc supports
(fixed upstream by pytorch/pytorch#185873, issue #185509); see
`_keep_mutation_renames`.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor import lowering
from torch._inductor import scheduler
from torch._inductor.virtualized import V

from sharc._compile.ops import WAIT_GATHER, WAIT_REDUCE_SCATTER


def _keep_mutation_renames() -> None:
    """Make `SchedulerNode.recompute_size_and_body` keep the node's mutation
    renames.

    A read of a buffer that a scatter mutated (an `index_put` into a zero
    buffer: the backward of indexing) is recorded under the scatter's output
    name, which is what orders the reader after the scatter. The C++
    backend recomputes a node's loop body to align loop ranges before it
    fuses two pointwise nodes, and that re-extracts the node's reads under
    the buffers' real names; Inductor reapplies the renames only when the
    node also holds a fake (Weak/Star) dependency. Without them the fused
    kernel depends on the zero fill, not on the scatters, and is scheduled
    before them: it reads zeros, a silent wrong gradient. sharc's backward
    graphs hit this (e.g. a gathered weight's gradient term fused with the
    sum of indexed gradients). Reapplying the renames is a no-op where
    Inductor already did (names are renamed to their final writer)."""
    recompute = scheduler.SchedulerNode.recompute_size_and_body
    if getattr(recompute, "_sharc_keeps_mutation_renames", False):
        return

    @functools.wraps(recompute)
    def recompute_size_and_body(self, *args, **kwargs):
        recompute(self, *args, **kwargs)
        if self.mutation_renames:
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_size_and_body._sharc_keeps_mutation_renames = True
    scheduler.SchedulerNode.recompute_size_and_body = recompute_size_and_body


@functools.cache
def register() -> None:
    _keep_mutation_renames()
    for op in (WAIT_GATHER, WAIT_REDUCE_SCATTER):
        _register_never_reused(op)


def _register_never_reused(op) -> None:
    """Lowers `op` as its fallback kernel, its outputs never reused."""
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _never_reused(*args, **kwargs):
        outputs = fallback(*args, **kwargs)
        for out in torch.utils._pytree.tree_leaves(outputs):
            V.graph.never_reuse_buffers.add(out.get_name())
        return outputs
