"""Unsharded checkpoints: full tensors under the original names."""

from __future__ import annotations

import torch

from sharc import _rank_check
from sharc._state_dict_hooks import own_state_dict
from sharc.api import sharded_root


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter gathered to its true shape
    (on every rank). Collective: every rank must call it (checked: a rank
    that calls it alone raises). Tied parameters appear under each of their
    names, as in nn.Module.state_dict()."""
    root = sharded_root(module)
    root.checks.agree(_rank_check.FULL_STATE_DICT)
    gathered: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in own_state_dict(module).items():
        ref = root.refs_by_shard.get(id(value))
        if ref is None:
            out[name] = value.detach().clone()
            continue
        if ref.pid not in gathered:
            gathered[ref.pid] = root.runtime.read_full(ref.pid)
        out[name] = gathered[ref.pid]
    return out


def load_full_state_dict(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads an unsharded state dict: each rank keeps its slice of every
    parameter and a copy of every buffer. Raises on missing or unexpected keys
    and on shape mismatches before changing anything. Collective: every rank
    must load the same state dict, which is checked (an order-sensitive
    checksum of every name, shape and byte, exchanged before anything
    changes): a load on one rank only, or of another checkpoint on one rank,
    raises instead of leaving a model that is part one, part the other."""
    root = sharded_root(module)
    own = own_state_dict(module)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    for name, value in own.items():
        given = state_dict[name]
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"load_full_state_dict: '{name}' is a {type(given).__name__}, not a "
                            "tensor; pass the full tensors (e.g. from sharc.full_state_dict or "
                            "an unsharded model's state_dict())")
        ref = root.refs_by_shard.get(id(value))
        shape = ref.shape if ref is not None else tuple(value.shape)
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"load_full_state_dict: '{name}' has shape "
                             f"{tuple(state_dict[name].shape)}, the module expects {shape}")
    root.checks.agree(_rank_check.LOAD_FULL_STATE_DICT,
                      value=_rank_check.checksum({k: state_dict[k] for k in own}))
    with torch.no_grad():
        for name, value in own.items():
            ref = root.refs_by_shard.get(id(value))
            if ref is None:
                value.copy_(state_dict[name])
            else:
                root.runtime.load_full(ref.pid, state_dict[name])
