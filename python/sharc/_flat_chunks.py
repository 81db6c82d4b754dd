"""Rectangles of an N-D tensor that cover a contiguous range of its flat
(row-major) elements.

sharc gives rank r the flat elements [r*s, (r+1)*s) of each parameter, which
in the parameter's true shape is usually not a rectangle: for a matrix it is a
partial first row, some whole rows and a partial last row. Checkpoint formats
describe shards as rectangles (offsets and sizes per dimension), so a rank's
range is split into the fewest row-major-contiguous rectangles. See
docs/design/checkpoints.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FlatChunk:
    """One rectangle: `offsets`/`sizes` in the true shape, and where its
    elements start in the flat tensor (they are contiguous there)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_chunks(shape: tuple[int, ...], start: int, stop: int) -> list[FlatChunk]:
    """The rectangles covering flat elements [start, stop) of a tensor of
    `shape`, in flat order. Every rectangle has the form (1, ..., 1, k, full
    trailing dims), so it is a contiguous run of the flat tensor; a range
    yields at most 2 * ndim - 1 of them. An empty range yields none."""
    n = math.prod(shape)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {n} elements")
    if start == stop:
        return []
    if not shape:  # 0-dim: its single element
        return [FlatChunk((), (), 0)]
    return _split(tuple(shape), start, stop, (), 0)


def _split(shape, start, stop, prefix, base) -> list[FlatChunk]:
    """Recursion over the leading dimension. `prefix` holds the offsets of
    the dimensions already fixed (each of size 1), `base` their flat start."""
    row = math.prod(shape[1:])  # elements per index of the leading dimension
    ones = (1,) * len(prefix)
    if row == 0:  # unreachable for non-empty ranges; keeps the division safe
        return []
    first, last = start // row, (stop - 1) // row  # leading indices touched
    if start % row == 0 and stop % row == 0 or len(shape) == 1:
        # whole rows (or single elements at the last dimension)
        count = last - first + 1 if len(shape) > 1 else stop - start
        lead = first if len(shape) > 1 else start
        return [FlatChunk(prefix + (lead,) + (0,) * (len(shape) - 1), ones + (count,) + shape[1:],
                          base + lead * row)]
    if first == last:  # inside one row: recurse into it
        return _split(shape[1:], start - first * row, stop - first * row, prefix + (first,),
                      base + first * row)
    chunks = []
    head_end = (first + 1) * row if start % row else first * row
    if start % row:
        chunks += _split(shape, start, head_end, prefix, base)
    body_end = last * row if stop % row else stop
    if body_end > head_end:
        chunks += _split(shape, head_end, body_end, prefix, base)
    if stop % row:
        chunks += _split(shape, body_end, stop, prefix, base)
    return chunks


def owned_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The flat elements of a parameter that `rank` owns under sharc's layout
    (shard size ceil(numel / W)), clipped to the real elements: padding is
    not part of any chunk."""
    shard = -(-numel // world_size)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)
