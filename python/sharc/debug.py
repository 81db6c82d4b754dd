"""Debug mode: a read of a released parameter raises a typed error naming
the operator.

A released buffer keeps its shape but holds 0 bytes, and any kernel reading
it raises a RuntimeError from the storage (outside debug mode too). Inside
`released_reads_raise()` every operator first checks its tensor arguments,
so the error is a ReleasedParameterRead that names the operator, raised
before any kernel runs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sharc._state import sharded_root


class ReleasedParameterRead(RuntimeError):
    pass


class released_reads_raise(TorchDispatchMode):
    """Context manager: raise ReleasedParameterRead when an operator reads a
    tensor whose storage has been released (slow; for debugging). Given the
    sharded module, the error names the parameter that was read."""

    def __init__(self, module: torch.nn.Module | None = None):
        super().__init__()
        self._names: dict[int, str] = {}
        if module is not None:
            root = sharded_root(module)
            for ref in root.refs_by_shard.values():
                storage = root.runtime.padded_base(ref.pid).untyped_storage()
                self._names[storage._cdata] = ref.fqn

    def _what(self, t: torch.Tensor) -> str:
        name = self._names.get(t.untyped_storage()._cdata)
        return f"parameter '{name}'" if name else "a tensor"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0:
                needed = (t.storage_offset() + 1 + sum(
                    (s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
                if t.untyped_storage().nbytes() < needed:
                    raise ReleasedParameterRead(
                        f"{func} read {self._what(t)} of shape {tuple(t.shape)} whose "
                        "storage was released by sharc: a parameter gathered earlier was "
                        "kept past its release; read the module attribute again instead "
                        "of keeping it")
        return func(*args, **kwargs)
