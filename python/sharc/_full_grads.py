"""Full gradients for sharc.unsharded(with_grads=True): each shard's
gradient gathered to its parameter's full shape, and written back to the
shards on exit (writeback=True).

Each shard's `.grad` (the averaged gradient's slice, as the optimizer
reads it) is laid out like the shard (`_gather_flat.gather_full`). Whether
a parameter has a gradient is first agreed over the group (one
all-reduce), so every rank gathers the same
parameters in the same order; a rank without one (its `.grad` set to None by
hand) sends zeros. Under hybrid sharding the replicas hold the same
gradients, so the shard group alone is enough.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharc._gather_flat import gather_full
from sharc.checkpoint.sharded_view import copy_into_flat


def gather(refs, fulls: dict, group) -> None:
    """Gives each full tensor in `fulls` (by parameter id) the gathered
    gradient of its shard as `.grad`, None where no rank has one."""
    if not refs:
        return
    device = refs[0].shard.device
    has = torch.tensor([ref.shard.grad is not None for ref in refs], dtype=torch.int32,
                       device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    for ref, anyone_has in zip(refs, has.tolist()):
        full = fulls[ref.pid]
        if not anyone_has:
            full.grad = None
            continue
        shard = ref.shard
        mine = shard.grad if shard.grad is not None else torch.zeros_like(shard)
        full.grad = gather_full(mine, ref.shape, group).to(full.dtype)


def write_back(refs, fulls: dict, group) -> None:
    """Each shard's `.grad` becomes its slice of the full tensor's `.grad`
    (None where that is None). No collective: every rank holds the same
    full gradients (checked by the caller)."""
    for ref in refs:
        full_grad = fulls[ref.pid].grad
        shard = ref.shard
        if full_grad is None:
            shard.grad = None
            continue
        grad = torch.zeros_like(shard)  # the padding stays zero
        copy_into_flat(full_grad, grad, ref.shape, group)
        shard.grad = grad
