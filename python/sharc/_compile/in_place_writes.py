"""Writes in place to a gathered parameter inside a compiled forward.

A gathered parameter is a copy of the shards that lives until its release:
a write to it (`self.weight.mul_(2)`, `w += 1`, `nn.init.zeros_(w)`, through a
view too) would change this call's computation and never the parameter.
Eager sharc reports it at the release, from the tensor's version counter;
a compiled graph has no such counter (AOTAutograd turns the write into a new
value), so the Dynamo graph is checked before it is compiled: an in-place op
whose target shares storage with a gather's value is refused, and so is
`F.embedding(..., max_norm=...)` on one (it renormalises the rows it looks up
in place: `nn.Embedding(max_norm=...)`).
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from sharc._compile.errors import SharcCompileError

_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                       operator.imatmul, operator.setitem}


def refuse_writes_to_gathered(gm: fx.GraphModule) -> None:
    """Raises SharcCompileError naming the first write in place to a gathered
    parameter (or a view of one) in a Dynamo graph."""
    import torch

    gather_ops = {torch.ops.sharc.all_gather.default, torch.ops.sharc.all_gather,
                  torch.ops.sharc.gather.default, torch.ops.sharc.gather}
    gathered: dict[StorageWeakRef, str] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "call_function" and node.target in gather_ops:
            if isinstance(value, torch.Tensor):
                gathered[StorageWeakRef(value.untyped_storage())] = node.name
            continue
        target = _written_in_place(node)
        target_value = target.meta.get("example_value") if isinstance(target, fx.Node) else None
        if isinstance(target_value, torch.Tensor) and \
                StorageWeakRef(target_value.untyped_storage()) in gathered:
            raise SharcCompileError(
                f"sharc: the compiled forward writes in place to a gathered parameter "
                f"('{_op_name(node)}' at {_where(node)}); the change never reaches the shards "
                "and is lost when the gathered value is released. Change parameters outside "
                "forward, on every rank, inside `with sharc.unsharded(model, "
                "writeback=True):`, or compute with a changed copy (`w = self.weight * s`)")


def _written_in_place(node: fx.Node):
    """The argument `node` writes in place, or None."""
    if _writes_in_place(node) and node.args:
        return node.args[0]
    if _renorms_embedding(node):  # F.embedding(idx, w, max_norm=...) rescales rows of w
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return None


def _renorms_embedding(node: fx.Node) -> bool:
    # By name: Dynamo may record a wrapper of torch.nn.functional.embedding.
    if node.op != "call_function" or (getattr(node.target, "__module__", None),
                                       getattr(node.target, "__name__", None)) != \
            ("torch.nn.functional", "embedding"):
        return False
    # embedding(input, weight, padding_idx, max_norm, ...)
    max_norm = node.args[3] if len(node.args) > 3 else node.kwargs.get("max_norm")
    return max_norm is not None


def _writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and \
            getattr(node.target, "__module__", None) in (None, "torch", "torch._C._TensorBase")
    return False


def _op_name(node: fx.Node) -> str:
    if _renorms_embedding(node):
        return "embedding with max_norm, which rescales rows of its weight in place"
    return str(node.target) if node.op == "call_method" else getattr(
        node.target, "__name__", str(node.target))


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    return f"{lines[-2]}: {lines[-1]}" if len(lines) >= 2 else node.name
