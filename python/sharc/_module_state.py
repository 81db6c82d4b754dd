"""What sharc keeps on each module it shards: one object under one attribute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sharc._eager_schedule import EagerSchedule
    from sharc._param_ref import ShardedParamRef
    from sharc.api import _ShardedRoot

_ATTRIBUTE = "_sharc"


@dataclass(eq=False, slots=True)
class ModuleState:
    refs: dict[str, ShardedParamRef]  # the module's own sharded parameters, by local name
    schedule: EagerSchedule  # the root's gather/release policy, shared by its modules
    root: _ShardedRoot | None = None  # only on the module shard() was called on


def attach(module: torch.nn.Module, state: ModuleState) -> None:
    # Not through nn.Module.__setattr__: the state is neither a parameter,
    # a buffer nor a submodule, and must not show up as one.
    object.__setattr__(module, _ATTRIBUTE, state)


def state_of(module: torch.nn.Module) -> ModuleState | None:
    """The state shard() left on `module`, or None if it did not shard it."""
    return module.__dict__.get(_ATTRIBUTE)
