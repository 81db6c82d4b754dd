"""Weight-decay groups chosen by `p.dim()` over flat shards, warned of.

[Note: decay groups by dimension]
A common way to build an optimizer's groups decays the matrices and not
the vectors: `[p for p in model.parameters() if p.dim() >= 2]` with weight
decay, the rest without (nanoGPT's `configure_optimizers`, timm's
`param_groups_weight_decay` through `create_optimizer_v2`). After shard()
every parameter the optimizer sees is a flat 1-D shard, so every one lands
in the group without decay and the decaying group is left empty: training
runs with no weight decay at all, silently. The README says to choose by
name; this check catches code that did not. At an optimizer's first step
(and again after add_param_group) it looks for that signature: a group that
asks for weight decay while every shard of a parameter of two or more
dimensions sits in groups without it (frozen ones aside; a parameter sharc
does not hold counts by its own shape). Only a warning, as a model could mean
it; the message names a matrix left undecayed and the way out. timm drops
the empty group and builds the optimizer with no decay, which cannot be
told from a choice of none: not warned of (the README names it).
"""

from __future__ import annotations

import warnings
import weakref

import torch

_FULL_SHAPE = "_sharc_full_shape"  # on a shard (nn.Parameter): its parameter's shape and name

# optimizer -> how many param groups it had when last checked
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def mark_shard(shard: torch.nn.Parameter, shape: tuple[int, ...], fqn: str) -> None:
    setattr(shard, _FULL_SHAPE, (shape, fqn))


def check(optimizer: torch.optim.Optimizer) -> None:
    """Warns once per optimizer (again after its groups change) when its
    weight-decay groups look chosen by the dimension of flat shards."""
    groups = optimizer.param_groups
    if _CHECKED.get(optimizer) == len(groups):
        return
    _CHECKED[optimizer] = len(groups)
    if not any(_decays(group) for group in groups):  # an empty one too
        return
    params = [(p, _decays(group)) for group in groups for p in group["params"]]
    if not any(hasattr(p, _FULL_SHAPE) for p, _ in params):
        return  # no shard of sharc's
    # Trainable matrices: a shard by its parameter's shape, any other
    # parameter (an unsharded head beside a sharded backbone) by its own.
    matrices = [(_name(p), decayed) for p, decayed in params
                if p.requires_grad and len(_shape(p)) >= 2]
    if not matrices or any(decayed for _, decayed in matrices):
        return
    warnings.warn(
        f"sharc: this {type(optimizer).__name__} has a param group with weight decay, yet "
        f"no parameter of two or more dimensions is decayed ('{matrices[0][0]}' is in a group "
        "without it). After sharc.shard() every parameter the optimizer holds is a flat 1-D "
        "shard, so groups chosen by p.dim() or p.ndim (p.dim() >= 2 decayed, as nanoGPT's "
        "configure_optimizers chooses) put every parameter in the group without decay. "
        "Choose the groups from model.named_parameters() by name instead (biases and norm "
        "weights undecayed; the names are unchanged by shard())", stacklevel=4)


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return getattr(p, _FULL_SHAPE, (tuple(p.shape), None))[0]


def _name(p: torch.Tensor) -> str:
    return getattr(p, _FULL_SHAPE, ((), "an unsharded parameter"))[1]


def _decays(group: dict) -> bool:
    decay = group.get("weight_decay", 0)
    return isinstance(decay, (int, float)) and decay > 0
