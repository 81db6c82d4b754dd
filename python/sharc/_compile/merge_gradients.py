"""Backward-graph rewrite: one reduction per parameter gradient.

Autograd adds up the gradient contributions of a parameter read more than
once (tied weights, a layer called twice, gathers that AOTAutograd merged):
the backward graph then holds reduce_scatters whose shard gradients are
summed, in any shape (a chain, a tree, one reduction added to itself).
Reduce-scatter is linear, so the bridge computes the same sum on the full
gradients and reduces once: less communication, and every gradient is then
reduced exactly once, as the IR verifier demands.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from sharc._compile.errors import SharcCompileError
from sharc._compile.ops import REDUCE_SCATTER, is_call, is_exit_cast, param_key

_ADD = torch.ops.aten.add.Tensor


def merge_gradient_reductions(graph: fx.Graph) -> int:
    """Rewrites each parameter's sum of shard gradients into one reduce_scatter
    of the summed full gradient; returns the number of parameters rewritten."""
    by_param: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if is_call(node, REDUCE_SCATTER):
            by_param[param_key(node)].append(node)
    merged = 0
    for key, reductions in by_param.items():
        if len(reductions) > 1 or _read_in_graph(reductions[0]):
            _merge(graph, key, reductions)
            merged += 1
    return merged


def _leaves_graph(node: fx.Node) -> bool:
    return node.op == "output" or is_exit_cast(node)


def _read_in_graph(reduction: fx.Node) -> bool:
    return not all(_leaves_graph(u) for u in reduction.users)


def _merge(graph: fx.Graph, key: tuple[str, int], reductions: list[fx.Node]) -> None:
    tree = _sum_nodes(reductions)
    roots = [n for n in tree if any(u not in tree for u in n.users)]
    if len(roots) != 1 or not all(_leaves_graph(u) for u in roots[0].users):
        raise SharcCompileError(
            f"sharc: the gradient of parameter {key[1]} (group '{key[0]}') is combined "
            "with something other than additions before it leaves the backward graph; "
            "this is a sharc bug, please report it with the model")
    root = roots[0]
    lifted: dict[fx.Node, fx.Node] = {r: r.args[0] for r in reductions}
    with graph.inserting_before(root):
        total = _lift(graph, root, lifted)
        reduced = graph.call_function(REDUCE_SCATTER, (total, *key))
        reduced.meta.update(root.meta)
    root.replace_all_uses_with(reduced)
    for node in reversed(list(graph.nodes)):
        if node in tree and not node.users:
            graph.erase_node(node)


def _sum_nodes(reductions: list[fx.Node]) -> set[fx.Node]:
    """The reductions and every add that combines only them (transitively)."""
    tree = set(reductions)
    grew = True
    while grew:
        grew = False
        for node in list(tree):
            for user in node.users:
                if user not in tree and is_call(user, _ADD) and not user.kwargs and all(
                        a in tree for a in user.args):
                    tree.add(user)
                    grew = True
    return tree


def _lift(graph: fx.Graph, node: fx.Node, lifted: dict[fx.Node, fx.Node]) -> fx.Node:
    """The full-gradient counterpart of a shard-gradient sum node."""
    if node not in lifted:
        a, b = (_lift(graph, arg, lifted) for arg in node.args)
        total = graph.call_function(_ADD, (a, b))
        total.meta["val"] = a.meta.get("val")
        lifted[node] = total
    return lifted[node]
