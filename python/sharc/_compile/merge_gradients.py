"""Backward-graph rewrite: one reduction per parameter gradient.

A parameter read twice in forward (tied weights) is captured as two
all_gathers, so backward holds two reduce_scatters whose shard gradients
autograd adds. Reduce-scatter is linear, so the bridge adds the full
gradients first and reduces once: half the communication, and every
gradient is then reduced exactly once, as the IR verifier demands.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from sharc._compile.errors import SharcCompileError
from sharc._compile.ops import REDUCE_SCATTER, is_call, param_key

_ADD = torch.ops.aten.add.Tensor


def merge_gradient_reductions(graph: fx.Graph) -> int:
    """Rewrites each parameter's sum of reduce_scatters into one reduce_scatter
    of the summed gradient; returns the number of parameters rewritten."""
    by_param: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if is_call(node, REDUCE_SCATTER):
            by_param[param_key(node)].append(node)
    merged = 0
    for key, reductions in by_param.items():
        if len(reductions) > 1:
            _merge(graph, key, reductions)
            merged += 1
    return merged


def _merge(graph: fx.Graph, key: tuple[str, int], reductions: list[fx.Node]) -> None:
    tree, root = _sum_tree(reductions)
    if root is None:
        raise SharcCompileError(
            f"sharc: the {len(reductions)} gradient reductions of parameter {key[1]} "
            f"(group '{key[0]}') are not simply added together; this is a sharc bug, "
            "please report it with the model")
    with graph.inserting_before(root):
        total = reductions[0].args[0]
        for r in reductions[1:]:
            total = _node_like(graph.call_function(_ADD, (total, r.args[0])), r.args[0])
        reduced = graph.call_function(REDUCE_SCATTER, (total, *key))
        reduced.meta.update(root.meta)
    root.replace_all_uses_with(reduced)
    for node in reversed(list(graph.nodes)):
        if node in tree:
            graph.erase_node(node)


def _sum_tree(reductions: list[fx.Node]) -> tuple[set[fx.Node], fx.Node | None]:
    """The add nodes that combine exactly `reductions`, and their root."""
    tree = set(reductions)
    grew = True
    while grew:
        grew = False
        for node in list(tree):
            for user in node.users:
                if user not in tree and is_call(user, _ADD) and all(
                        a in tree for a in user.args):
                    tree.add(user)
                    grew = True
    roots = [n for n in tree if any(u not in tree for u in n.users) or not n.users]
    inner_ok = all(all(u in tree for u in n.users) and len(n.users) == 1
                   for n in tree if n not in roots)
    if len(roots) != 1 or not inner_ok:
        return tree, None
    return tree, roots[0]


def _node_like(node: fx.Node, like: fx.Node) -> fx.Node:
    node.meta["val"] = like.meta.get("val")
    return node
