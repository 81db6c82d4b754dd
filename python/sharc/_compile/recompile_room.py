"""Room in Dynamo's recompile limit for one compiled graph per sharded module.

A graph the sharc backend compiles names the parameters it gathers: their
runtime ids and group are constants of the graph, and Dynamo guards on
them. So the instances of one module class, compiled one frame each, get one
cache entry each: the blocks of a model compiled one by one (FSDP's habit,
`for block in model.blocks: block.compile(backend="sharc")`), or the blocks
Dynamo compiles on their own when it could not compile their parent's frame.
Dynamo stops compiling a code object after `recompile_limit` entries (8)
and runs every later instance uncompiled, so a 12-block model would run 4
blocks eagerly. shard() therefore raises the limit to what the modules
sharded in this process need, plus Dynamo's own allowance for genuine
recompiles (new shapes, grad mode); it never lowers a limit and logs (the
"sharc" logger, level INFO) when it raised one.
"""

from __future__ import annotations

import collections
import logging
import types
import weakref

import torch
import torch._dynamo.config as dynamo_config

_log = logging.getLogger("sharc")


class RecompileRoom:
    """Counts the live sharded modules by the code object of their forward,
    across the models sharded in this process (a code object's cache
    entries are shared by every caller), and keeps Dynamo's limits above
    the count."""

    def __init__(self) -> None:
        self._instances: dict[types.CodeType, weakref.WeakSet] = collections.defaultdict(
            weakref.WeakSet)
        self._allowance: int | None = None  # the limit as found, before sharc raised it

    def add(self, root: torch.nn.Module) -> None:
        for module in root.modules():
            code = _forward_code(module)
            if code is not None:
                self._instances[code].add(module)
        if self._instances:
            self._raise_limits(max(len(live) for live in self._instances.values()))

    def _raise_limits(self, instances: int) -> None:
        if not hasattr(dynamo_config, "accumulated_recompile_limit"):
            return  # an older torch names its limits otherwise: left as they are
        if self._allowance is None:
            self._allowance = dynamo_config.recompile_limit
        needed = instances + self._allowance
        if dynamo_config.recompile_limit < needed:
            _log.info("raised torch._dynamo.config.recompile_limit from %d to %d: a module "
                      "compiled on its own compiles once per instance (its graph names the "
                      "parameters it gathers), and %d sharded modules share one forward",
                      dynamo_config.recompile_limit, needed, instances)
            dynamo_config.recompile_limit = needed
        if dynamo_config.accumulated_recompile_limit < needed:
            dynamo_config.accumulated_recompile_limit = needed


def _forward_code(module: torch.nn.Module) -> types.CodeType | None:
    """The code a call of `module` runs; None for containers that are never
    called (ModuleList, ModuleDict: their forward raises)."""
    forward = getattr(type(module), "forward", None)
    if forward is torch.nn.Module.forward:  # the shared "not implemented" stub
        return None
    return getattr(forward, "__code__", None)


ROOM = RecompileRoom()
