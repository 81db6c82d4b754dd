"""The torch.ops.sharc operators the compile path reads and writes, and the
facts about FX nodes the bridge needs."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

ALL_GATHER = torch.ops.sharc.all_gather.default
REDUCE_SCATTER = torch.ops.sharc.reduce_scatter.default
START_GATHER = torch.ops.sharc.start_gather.default
WAIT_GATHER = torch.ops.sharc.wait_gather.default
RELEASE = torch.ops.sharc.release.default
START_REDUCE_SCATTER = torch.ops.sharc.start_reduce_scatter.default
WAIT_REDUCE_SCATTER = torch.ops.sharc.wait_reduce_scatter.default
PREFETCH_NEXT_GRAPH = torch.ops.sharc.prefetch_next_graph.default
START_REPLICATE_ALL_REDUCE = torch.ops.sharc.start_replicate_all_reduce.default
ESCAPING_COPY = torch.ops.sharc.escaping_copy.default

# Neither FX dead-code elimination nor Inductor's scheduler may drop these:
# the starts launch collectives and release frees memory (and has no output
# anyone reads), as may a graph's prefetch point.
fx.node.has_side_effect(START_GATHER)
fx.node.has_side_effect(RELEASE)
fx.node.has_side_effect(START_REDUCE_SCATTER)
fx.node.has_side_effect(PREFETCH_NEXT_GRAPH)
fx.node.has_side_effect(START_REPLICATE_ALL_REDUCE)

_GRAPH_KINDS = torch.classes.sharc.Runtime.graph_kinds()  # the C++ GraphKind
FORWARD_GRAPH, BACKWARD_GRAPH = _GRAPH_KINDS["forward"], _GRAPH_KINDS["backward"]
"""The graph kinds the runtime orders compiled graphs by (cross-graph
prefetch follows a graph only by one of its own kind), read from the
runtime so the two cannot drift."""


def is_call(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def param_key(node: fx.Node) -> tuple[str, int]:
    """(group name, parameter id) of an all_gather or reduce_scatter node."""
    group, pid = node.args[-2], node.args[-1]
    return str(group), int(pid)


def is_view(node: fx.Node) -> bool:
    """Whether the node's output aliases its first input (a view op, or an
    element of a multi-output view)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


_CAST = torch.ops.prims.convert_element_type.default
_TO_COPY = torch.ops.aten._to_copy.default


def dtype_name(dtype: torch.dtype) -> str:
    """The IR's name of a dtype: torch's without the `torch.` prefix."""
    return str(dtype).removeprefix("torch.")


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a pure element-wise cast converts to (what autocast and the
    mixed-precision policy emit: convert_element_type, or a _to_copy that
    changes nothing but the dtype); None for anything else."""
    if is_call(node, _CAST):
        return node.args[1]
    if is_call(node, _TO_COPY) and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        val, src = node.meta.get("val"), node.args[0].meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) \
                and val.device == src.device and val.stride() == src.stride():
            return node.kwargs["dtype"]
    return None


def is_exit_cast(node: fx.Node) -> bool:
    """A dtype cast whose result only leaves the graph: AOTAutograd casts a
    reduced gradient to its shard's dtype this way, since it does not model
    grad_dtype. The reduction already delivers the shard's grad_dtype, which
    the autograd engine takes as the shard's gradient as it is, so the bridge
    drops the cast: kept, it would round an fp32 gradient of a bf16 shard
    through bf16."""
    return cast_dtype(node) is not None and all(u.op == "output" for u in node.users)


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
