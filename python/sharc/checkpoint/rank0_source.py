"""Full tensors that only rank 0 of the model's group holds: where
sharc.load_full_state_dict(..., from_rank0=True) reads from.

Rank 0 opens its state dict or file (load_sources.open_source) and sends
every rank the names, shapes and dtypes first, or the error it met opening
or checking them, which every rank then raises (rank 0 its own), so a bad
path or a non-tensor value on rank 0 never leaves the others waiting. Then,
tensor by tensor in the order the load writes them, rank 0 broadcasts
whether it could read the tensor (a failing read raises on every rank),
then the full value, and each rank keeps its slice: a rank holds at most one full
tensor beyond its shards, and the file need exist on rank 0's host only.
A broadcast per tensor moves W - 1 copies of it where a scatter of slices
would move one; a load runs once per job, and one collective kind for
parameters and buffers alike keeps every rank's calls in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharc.checkpoint.load_sources import open_source


class Rank0Source:
    """The load_sources interface over rank 0's source; every read is a
    collective, so every rank must read the same keys in the same order."""

    collective = True

    def __init__(self, given, group, device: torch.device):
        self._group = group
        self._device = device
        self._is_source = dist.get_rank(group) == 0
        self._source = None
        failure = None
        answer = None
        if self._is_source:
            try:
                self._source = open_source(given)
                for key in self._source.keys():
                    self._source.check_tensor(key)
                answer = {key: (self._source.shape(key), self._source.dtype(key))
                          for key in self._source.keys()}
            except Exception as e:  # every rank learns of it before raising
                failure = e
                answer = f"{type(e).__name__}: {e}"
        box = [answer]
        dist.broadcast_object_list(box, group=group, group_src=0)
        if failure is not None:
            raise failure
        if isinstance(box[0], str):
            raise RuntimeError("load_full_state_dict(from_rank0=True): rank 0 could not read "
                               f"its state dict: {box[0]}")
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = box[0]

    def keys(self) -> list[str]:
        return list(self._meta)

    def check_tensor(self, key: str) -> None:
        """Checked on rank 0 before the names were sent."""

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta[key][0])

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][1]

    def read(self, key: str) -> torch.Tensor:
        value, failure = None, None
        if self._is_source:
            try:
                value = self._source.read(key).to(self._device).contiguous()
            except Exception as e:  # a file cut short after its header: tell the others
                failure = e
        # Whether rank 0 has the tensor, before the tensor itself, so that a
        # read failing on rank 0 raises everywhere instead of leaving the
        # others waiting in the broadcast.
        ok = torch.tensor([failure is None], dtype=torch.int32, device=self._device)
        dist.broadcast(ok, group=self._group, group_src=0)
        if failure is not None:
            raise failure
        if not ok.item():
            raise RuntimeError(f"load_full_state_dict(from_rank0=True): rank 0 failed to read "
                               f"'{key}' (its error says why); the tensors before it were "
                               "loaded, the rest not: load again")
        if value is None:
            value = torch.empty(self.shape(key), dtype=self.dtype(key), device=self._device)
        dist.broadcast(value, group=self._group, group_src=0)
        if self._source is not None:  # rank 0 read the whole tensor, not a slice
            self._source.done_with(value.nbytes)
        return value

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self.read(key).reshape(-1)[lo:hi]

    def done_with(self, nbytes: int) -> None:
        """Told per read instead (read() knows the whole tensor's bytes)."""
