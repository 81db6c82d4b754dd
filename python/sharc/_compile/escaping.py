"""Gathered parameters that leave a compiled graph as its outputs.

Code that keeps a reference to a gathered weight (a forward hook storing
`module.weight.detach()`, a forward assigning it to an attribute) makes
Dynamo return that weight from the graph. Returned as is, it would be
released inside the graph after its last use, leaving the caller a tensor
whose every read raises. So the graph returns a copy instead, which lives as
long as the caller holds it, and sharc warns: a full copy per call, kept for
every layer, undoes the sharding.

Training graphs are rewritten in the joint graph, where every gathered value
among the outputs is one the caller gets back (a gathered value among the
partitioner's saved-for-backward values would be a sharc bug, which lowering
reports); inference graphs are rewritten when they are scheduled.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from sharc._compile.ops import ALL_GATHER, ESCAPING_COPY, is_call, is_view, param_key


def copy_escaping_gathers(graph: fx.Graph) -> int:
    """Replaces each graph output that is a gathered parameter (or a view of
    one) by a copy of it; warns naming the parameters. Returns how many
    outputs were copied."""
    gathered: dict[fx.Node, tuple[str, int]] = {}
    for node in graph.nodes:
        if is_call(node, ALL_GATHER):
            gathered[node] = param_key(node)
        elif is_view(node) and node.args and node.args[0] in gathered:
            gathered[node] = gathered[node.args[0]]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    copies: dict[fx.Node, fx.Node] = {}

    def copy(value: fx.Node) -> fx.Node:
        if value not in gathered:
            return value
        if value not in copies:
            # sharc's own copy op: Inductor drops an aten.clone whose result
            # has its input's metadata (remove_noop_ops).
            with graph.inserting_before(output):
                clone = graph.call_function(ESCAPING_COPY, (value,))
            if "val" in value.meta:
                clone.meta["val"] = ESCAPING_COPY(value.meta["val"])
            copies[value] = clone
        return copies[value]

    output.args = fx.node.map_arg(output.args, copy)
    if copies:
        _warn(sorted({gathered[v] for v in copies}))
    return len(copies)


def _warn(keys: list[tuple[str, int]]) -> None:
    from sharc._library import Runtime

    names = ", ".join(f"'{Runtime.for_group(group).name(pid)}'" for group, pid in keys)
    warnings.warn(
        f"sharc: a compiled graph returns the gathered value of {names} (a reference kept "
        "past its use, e.g. by a forward hook or an attribute set in forward); it returns "
        "a full-size copy each call, alive while you hold it. Keep only what you need "
        "(a norm, a slice) to stay within sharded memory", stacklevel=2)
