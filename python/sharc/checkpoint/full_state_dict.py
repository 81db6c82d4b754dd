"""Unsharded checkpoints: full tensors under the original names."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharc import _rank_check
from sharc._state import sharded_root, state_of, unwrap_compiled
from sharc.checkpoint.load import load
from sharc.checkpoint.state_dict_hooks import own_state_dict


def full_state_dict(module: torch.nn.Module, *, rank0_only: bool = False,
                    cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter gathered to its true shape.
    Tied parameters appear under each of their names, as in
    nn.Module.state_dict(). Collective: every rank must call it, with the
    same `rank0_only` (checked: a rank that calls it alone, or with the
    other choice, raises).

    By default every rank gets the whole dict. With `rank0_only=True` only
    rank 0 of the model's process group does (under hybrid sharding, rank 0
    of each replica's shard group); the other ranks get `{}` and hold at
    most one gathered tensor at a time, so a model bigger than one rank can
    be exported from rank 0 (whose host memory must hold it). With
    `cpu_offload=True` each value is moved to the CPU as it is gathered
    (for a model sharded on a GPU)."""
    if not isinstance(rank0_only, bool) or not isinstance(cpu_offload, bool):
        raise TypeError("sharc.full_state_dict: rank0_only and cpu_offload must be bools, got "
                        f"{rank0_only!r} and {cpu_offload!r}")
    root = sharded_root(module)
    root.require_values("sharc.full_state_dict was called")
    root.checks.agree(_rank_check.FULL_STATE_DICT, value=int(rank0_only))
    keeps = not rank0_only or dist.get_rank(root.group) == 0
    place = (lambda t: t.cpu()) if cpu_offload else (lambda t: t)
    # Inside sharc.unsharded() its full tensors are the parameters, with
    # what was written there that the shards do not hold yet.
    fulls = state_of(unwrap_compiled(module)).schedule.unsharded
    gathered: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in own_state_dict(module).items():
        ref = root.refs_by_shard.get(id(value))
        if ref is None:
            if keeps:
                out[name] = place(value.detach().clone())
            continue
        if ref.pid not in gathered:
            # Every rank reads (a collective), whether or not it keeps it.
            full = (root.runtime.read_full(ref.pid) if fulls is None
                    else fulls[ref.pid].detach().clone() if keeps else None)
            gathered[ref.pid] = place(full) if keeps else None
        if keeps:
            out[name] = gathered[ref.pid]
    return out


def load_full_state_dict(module: torch.nn.Module, state_dict, *, from_rank0: bool = False) -> None:
    """Loads unsharded values: each rank keeps its slice of every parameter
    and a copy of every buffer. `state_dict` is a dict of full tensors, or
    the path of a `torch.save` file (memory-mapped), a `.safetensors` file
    or a directory of them (a Hugging Face model's); a file is read one
    tensor at a time, each rank reading only its slice, so no rank holds the
    whole state dict. Raises on missing or unexpected keys and on shape or
    dtype mismatches before changing anything; a tied parameter needs one of
    its names. Loads into a model sharded from the meta device too, which
    then has its values (docs/design/meta-init.md). Collective: every rank
    must load the same values, which is checked before anything changes (a
    dict: an order-sensitive checksum of every name, shape and byte; a file:
    of its names, shapes, dtypes and size): a load on one rank only, or of
    another checkpoint on one rank, raises instead of leaving a model that
    is part one, part the other.

    With `from_rank0=True` only rank 0 of the model's process group reads
    `state_dict` (a dict or a path, which need exist on rank 0's host only);
    the other ranks' argument is not read (pass None). Rank 0 checks it and
    sends every rank the names, shapes and dtypes (or its error, which every
    rank raises), then each tensor in turn, of which each rank keeps its
    slice: a rank holds at most one full tensor beyond its shards. Every
    rank must pass from_rank0=True (checked). Flat sharding only: under
    hybrid sharding it raises before anything is sent."""
    if not isinstance(from_rank0, bool):
        raise TypeError(f"sharc.load_full_state_dict: from_rank0 must be a bool, got {from_rank0!r}")
    load(module, state_dict, from_rank0)
