"""A shard standing for its full parameter while user code runs on the full
model outside training: `sharc.unsharded()` and the initialisers that
`sharc.init_weights()` replays.

Both give a module's parameters at full size where `module.<name>` reads.
But `module.parameters()` and `named_parameters()` still yield the flat
shards the optimizer holds, and a loop over them (`for p in
model.parameters(): nn.init.normal_(p)`) would act on this rank's slice:
the same random values in every rank's slice, or a shape error. While such
code runs, this torch function mode hands every torch function and Tensor
method or property (`p.dim()`, `p.shape`, `p.copy_(...)`) the shard's full
tensor instead, except what a shard shares with it or owns as the
optimizer's parameter (dtype and device; `requires_grad`, `.grad`, hooks).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map


# What a shard shares with its full tensor, or what belongs to the shard the
# optimizer holds (autograd's metadata: freezing it, its gradient, its
# hooks): these reach the shard itself.
_THE_SHARDS_OWN = frozenset({
    "dtype", "device", "layout", "is_cuda", "is_cpu", "is_meta", "is_leaf", "grad_fn",
    "requires_grad", "requires_grad_", "grad", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "retains_grad"})


def _name(func) -> str:
    """A function's name; a property's (`p.grad`, `p.requires_grad = x`)
    for its getter and setter."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class ShardsAsFull(TorchFunctionMode):
    """`full_of(tensor)` is the full tensor a shard stands for, or None for
    any other tensor. With `full_grads`, `.grad` (read or set) is the full
    tensor's too: sharc.unsharded(with_grads=True) gives it the gathered
    gradient."""

    # How many are entered: a torch function mode is process-wide state
    # anyway, and code that must act on the shards themselves (clipping,
    # an optimizer step) asks it to refuse inside one.
    entered = 0

    def __init__(self, full_of: Callable[[torch.Tensor], torch.Tensor | None],
                 full_grads: bool = False):
        super().__init__()
        self.full_of = full_of
        self.shards_own = _THE_SHARDS_OWN - {"grad"} if full_grads else _THE_SHARDS_OWN

    def __enter__(self):
        ShardsAsFull.entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        ShardsAsFull.entered -= 1
        return super().__exit__(*exc)

    def _full(self, value):
        if isinstance(value, torch.Tensor):
            full = self.full_of(value)
            if full is not None:
                return full
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _name(func) not in self.shards_own:
            args, kwargs = tree_map(self._full, (args, kwargs))
        return func(*args, **kwargs)


def shard_lookup(refs) -> Callable[[torch.Tensor], int | None]:
    """The parameter id of a tensor that is one of `refs`' shards (by
    identity), else None."""
    by_id = {id(ref.shard): ref for ref in refs}

    def pid_of(tensor: torch.Tensor) -> int | None:
        ref = by_id.get(id(tensor))
        return ref.pid if ref is not None and ref.shard is tensor else None

    return pid_of
