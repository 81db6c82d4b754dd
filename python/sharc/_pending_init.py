"""A model sharded from the meta device, until its values arrive.

shard() of a model built on the meta device allocates this rank's shards
(zeros) and leaves the model in this state: forward refuses to run, and so
does an optimizer step over its shards, each naming the fix, until
sharc.init_weights() or sharc.load_full_state_dict() has given every
parameter and buffer its values. See docs/design/meta-init.md.
"""

from __future__ import annotations

import torch

# Set on each shard of a model awaiting its values (the parameter's name), so
# that the optimizer step pre-hook (_shard.py) can refuse a step over it.
AWAITING = "_sharc_awaiting_init"

FIX = ("call sharc.init_weights(model) (random initialisation, as if built normally with "
       "the same seed) or sharc.load_full_state_dict(model, path_or_state_dict) on every "
       "rank first")


class PendingInit:
    """What shard() left on a meta-built root until its values arrive."""

    def __init__(self, module: torch.nn.Module, device: torch.device, shards,
                 written_when_built: dict[int, int] | None = None) -> None:
        self.device = device  # where shards and materialised buffers live
        # Parameter id -> how many times the model's construction wrote it in
        # place (its meta tensor's version counter: an `nn.init` call in an
        # `__init__`), for the parameters written at all; for init_weights
        # (_init_rebuild.py, and materialize.py's check for lost writes).
        self.written_when_built = written_when_built or {}
        self._shards = list(shards)
        for name, shard in self._shards:
            setattr(shard, AWAITING, name)
        self._hook = module.register_forward_pre_hook(_refuse_forward, prepend=True)

    def finish(self) -> None:
        """Every value has arrived: forward and optimizer steps may run."""
        self._hook.remove()
        for _, shard in self._shards:
            if hasattr(shard, AWAITING):
                delattr(shard, AWAITING)


def refuse(what: str) -> None:
    raise RuntimeError(f"sharc: {what} before the model built on the meta device has its "
                       f"values: its shards are allocated but hold no values yet; {FIX}")


# Compiled forwards run it eagerly (a graph break) and raise the same way; it
# is removed once the values arrive, so trained models never pay for it.
@torch.compiler.disable
def _refuse_forward(module, args) -> None:
    refuse("forward ran")
