"""What sharc keeps on each module it shards: one object under one attribute,
and on the root module also what shard() leaves for everything after it
(checkpoints, loads, clipping, `unsharded`).

These are records only, at the bottom of the Python layers: they hold the
eager schedule but do not import it (see ModuleState.schedule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sharc._pending_init import PendingInit, refuse as refuse_unset

if TYPE_CHECKING:
    from sharc._param_ref import ShardedParamRef
    from sharc._rank_check import RankCheck

_ATTRIBUTE = "_sharc"


@dataclass(eq=False, slots=True)
class ModuleState:
    refs: dict[str, ShardedParamRef]  # the module's own sharded parameters, by local name
    # The root's gather/release policy, shared by its modules: a
    # sharc.eager.schedule.EagerSchedule. Typed loosely on purpose: the eager
    # layer stands above these records and imports them.
    schedule: object
    root: _ShardedRoot | None = None  # only on the module shard() was called on


def attach(module: torch.nn.Module, state: ModuleState) -> None:
    # Not through nn.Module.__setattr__: the state is neither a parameter,
    # a buffer nor a submodule, and must not show up as one.
    object.__setattr__(module, _ATTRIBUTE, state)


def state_of(module: torch.nn.Module) -> ModuleState | None:
    """The state shard() left on `module`, or None if it did not shard it."""
    return module.__dict__.get(_ATTRIBUTE)


class _ShardedRoot:
    """What shard() leaves on the root module for the checkpoint helpers.

    It keeps the group's name, not the group: a sharded module must not keep
    a process group alive past destroy_process_group() (the runtime holds it
    weakly too)."""

    def __init__(self, group, runtime, refs_by_param, checks: RankCheck):
        self.group_name = group.group_name
        self.runtime = runtime
        self.checks = checks  # every rank reached a collective call (_rank_check.py)
        self.refs_by_shard = {id(ref.shard): ref for ref in refs_by_param.values()}
        # Built on the meta device and awaiting its values (_pending_init.py).
        self.pending_init: PendingInit | None = None

    def require_values(self, what: str) -> None:
        """Raises, naming `what` and the fix, while the model awaits its values."""
        if self.pending_init is not None:
            refuse_unset(what)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group, while it exists."""
        return live_group(self.group_name, "this module was sharded on")


def live_group(group_name: str, what: str) -> dist.ProcessGroup:
    """The process group registered as `group_name`; raises, saying it was
    destroyed and what it served (`what`: "this module was sharded on"), when
    it no longer exists."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError:
        raise RuntimeError(
            f"sharc: the process group '{group_name}' {what} has been destroyed; build and "
            "shard the module again on a live group") from None


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The sharded module under torch.compile's OptimizedModule wrapper(s)."""
    while hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
        module = module._orig_mod
    return module


def sharded_root(module: torch.nn.Module) -> _ShardedRoot:
    """What shard() left on `module` (or on the module torch.compile wraps)."""
    state = state_of(unwrap_compiled(module))
    root = state.root if state is not None else None
    if root is None:
        raise RuntimeError("this module is not sharded: call sharc.shard(module) first")
    return root
