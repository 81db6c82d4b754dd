"""A flat shard seen as a torch.distributed ShardedTensor of the parameter's
true shape, for torch.distributed.checkpoint (DCP).

The ShardedTensor's local shards are views into the flat shard (no copy and
no communication): DCP writes them on save and copies into them on load, so
a load lands directly in the shard. Each rank's flat range becomes the
rectangles of `_flat_chunks`; every rank computes the whole (global) chunk
list itself because the layout is a pure function of (numel, W).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                             TensorProperties)

from sharc._flat_chunks import FlatChunk, flat_range_chunks, owned_range


def _rank_chunks(shape: tuple[int, ...], world: int, rank: int) -> list[FlatChunk]:
    chunks = flat_range_chunks(shape, *owned_range(math.prod(shape), world, rank))
    if not chunks:
        # A rank that owns no element (n < W, or n = 0) still gets one empty
        # chunk: DCP's load planner drops a ShardedTensor without local shards
        # from that rank's plan and then misreads the checkpoint's keys. It
        # sits past the last row so its index never equals a real chunk's.
        chunks = [FlatChunk((shape[0],) + (0,) * (len(shape) - 1), (0,) + tuple(shape[1:]), 0)]
    return chunks


def _placement(group, rank: int, device: torch.device) -> str:
    return f"rank:{dist.get_global_rank(group, rank)}/{device}"


def sharded_view(flat: torch.Tensor, shape: tuple[int, ...], group) -> ShardedTensor:
    """`flat` is this rank's padded flat shard (or a tensor laid out like it,
    such as an optimizer's exp_avg) of a tensor of true `shape`. Returns a
    ShardedTensor of global size `shape` (at least 1-D) whose local shards
    alias `flat`."""
    if not shape:
        raise ValueError("sharded_view: a 0-dim tensor has no chunks; see scalar_view")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = flat.detach()
    base = rank * flat.numel()  # flat index of flat[0] in the padded whole
    device = flat.device if flat.device.type == "cpu" else torch.device(
        flat.device.type, flat.device.index or 0)
    shards_md, local = [], []
    for q in range(world):
        for c in _rank_chunks(shape, world, q):
            md = ShardMetadata(shard_offsets=list(c.offsets), shard_sizes=list(c.sizes),
                               placement=_placement(group, q, device))
            shards_md.append(md)
            if q == rank:
                start = max(0, c.flat_start - base) if c.numel else 0
                view = flat[start:start + c.numel].view(c.sizes)
                local.append(Shard(tensor=view, metadata=md))
    props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(shape),
                                 tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta, process_group=group)


def scalar_view(flat: torch.Tensor, group) -> tuple[torch.Tensor, bool]:
    """A 0-dim tensor's checkpoint value: rank 0 owns its one element and
    returns a 0-dim view of it; other ranks return a scratch scalar that the
    caller must fill from rank 0 (the bool says so) before a save, since DCP
    writes a replicated tensor from whichever rank it picks. A load into the
    scratch scalar is discarded."""
    flat = flat.detach()
    if dist.get_rank(group) == 0:
        return flat[0:1].view(()), False
    return torch.zeros((), dtype=flat.dtype, device=flat.device), True


def copy_into_flat(value, flat: torch.Tensor, shape: tuple[int, ...], group) -> None:
    """Writes `value` into this rank's flat shard `flat` (padding untouched):
    a ShardedTensor of global `shape` (its local shards, which DCP has just
    filled; nothing to do if they already alias `flat`), or a full tensor of
    `shape` (this rank's slice of it is taken)."""
    if tuple(value.size()) != tuple(shape):
        raise ValueError(f"a value of shape {tuple(value.size())} cannot load into a "
                         f"parameter of shape {tuple(shape)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    base = rank * flat.numel()
    with torch.no_grad():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                start = _flat_index(shard.metadata.shard_offsets, shape) - base
                dest = flat[start:start + shard.tensor.numel()]
                if shard.tensor.numel() and shard.tensor.data_ptr() != dest.data_ptr():
                    dest.copy_(shard.tensor.reshape(-1))
            return
        lo, hi = owned_range(math.prod(shape), world, rank)
        flat[:hi - lo].copy_(value.reshape(-1)[lo:hi])


def _flat_index(offsets, shape) -> int:
    index = 0
    for o, d in zip(offsets, shape):
        index = index * d + o
    return index
