"""A tensor laid out like a parameter's shard gathered to the parameter's
full shape, for values the runtime does not hold (a shard's gradient, its
optimizer state), outside training.

A shard is this rank's flat slice of the parameter padded to W equal slices
(`_flat_chunks.owned_range`), so an all-gather over the shard group lays the
W slices end to end and its first `numel` elements are the full tensor.
Every rank must call it for the same tensors in the same order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def gather_full(flat: torch.Tensor, shape: tuple[int, ...], group) -> torch.Tensor:
    """The full tensor of `shape` whose slices the ranks' `flat` hold."""
    flat = flat.detach().reshape(-1).contiguous()
    slices = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    if flat.numel() > 0:
        dist.all_gather(slices, flat, group=group)
    return torch.cat(slices)[:math.prod(shape)].view(shape)
