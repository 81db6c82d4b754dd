"""Unsharded checkpoints: full tensors under the original names."""

from __future__ import annotations

import torch

from sharc import _rank_check
from sharc._state import sharded_root, state_of, unwrap_compiled
from sharc.checkpoint.load import load
from sharc.checkpoint.state_dict_hooks import own_state_dict


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter gathered to its true shape
    (on every rank). Collective: every rank must call it (checked: a rank
    that calls it alone raises). Tied parameters appear under each of their
    names, as in nn.Module.state_dict()."""
    root = sharded_root(module)
    root.require_values("sharc.full_state_dict was called")
    root.checks.agree(_rank_check.FULL_STATE_DICT)
    # Inside sharc.unsharded() its full tensors are the parameters, with
    # what was written there that the shards do not hold yet.
    fulls = state_of(unwrap_compiled(module)).schedule.unsharded
    gathered: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in own_state_dict(module).items():
        ref = root.refs_by_shard.get(id(value))
        if ref is None:
            out[name] = value.detach().clone()
            continue
        if ref.pid not in gathered:
            gathered[ref.pid] = (root.runtime.read_full(ref.pid) if fulls is None
                                 else fulls[ref.pid].detach().clone())
        out[name] = gathered[ref.pid]
    return out


def load_full_state_dict(module: torch.nn.Module, state_dict) -> None:
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
    is part one, part the other."""
    load(module, state_dict)
