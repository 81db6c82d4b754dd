"""Backward-graph rewrite: one reduction per parameter gradient.

Autograd adds up the gradient contributions of a parameter read more than
once (tied weights, a layer called twice, gathers that AOTAutograd merged):
the backward graph then holds reduce_scatters whose shard gradients are
summed, in any shape (a chain, a tree, one reduction added to itself).
Reduce-scatter is linear, so the bridge computes the same sum on the full
gradients and reduces once: less communication, and every gradient is then
reduced exactly once, as the IR verifier demands.

[Note: local gradient terms]
A shard can also be read directly, not through a gather: a penalty over
`model.parameters()` inside forward (the parameters are this rank's flat
shards). Its gradient is then a shard-shaped *local* term, this rank's own,
that autograd adds to the reduced gradient: eager sharc gives
`shard.grad = average of the full gradients, scattered + the local terms`.
The rule: a parameter's gradient that leaves the graph as a sum of
reductions and other shard-shaped values is rewritten to
`reduce_scatter(sum of the full gradients) + (sum of the local terms)`.
The local terms must not enter the reduction: it averages over the ranks
and scatters a full-shaped input, and a local term is neither. The add of
the local sum is kept outside the scheduling IR, like the exit casts
(`fx_to_ir.py` skips it and makes the output read the local sum;
`ir_to_fx.py` adds it to the waited shard gradient at the end of the
graph), so it comes after the reduction's wait wherever the passes put
that wait. Where the wait is left behind the graph ([Note: late reduction
waits]) the wait returns zeros, the graph returns `zeros + local`, and the
runtime adds the reduction into `.grad` later: each term counted once. That
needs the returned sum to be a tensor of its own, never the zeros' buffer
reused in place, which the runtime would take as untouched zeros and
overwrite (`inductor_lowerings.py`). Anything other than additions
(a scaled sum, `add` with `alpha`, a broadcast) still raises.
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
    of the summed full gradient, plus the sum of its local terms if any;
    returns the number of parameters rewritten."""
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
    local_terms = _local_terms(graph, tree)
    # With local terms the root's value is no longer a reduction's, so an exit
    # cast of it would not be the one ops.is_exit_cast drops: only the output.
    leaves = (lambda u: u.op == "output") if local_terms else _leaves_graph
    if len(roots) != 1 or not all(leaves(u) for u in roots[0].users) or any(
            not _same_shape(term, reductions[0]) for term in local_terms):
        _not_a_sum(key)
    root = roots[0]
    lifted = {r: r.args[0] for r in reductions}
    with graph.inserting_before(root):
        total = _lift(graph, root, tree, lifted)
        reduced = graph.call_function(REDUCE_SCATTER, (total, *key))
        reduced.meta.update(root.meta if not local_terms else reductions[0].meta)
        result = _add_local_terms(graph, reduced, local_terms, root) if local_terms else reduced
    root.replace_all_uses_with(result)
    for node in reversed(list(graph.nodes)):
        if node in tree and not node.users:
            graph.erase_node(node)


def _not_a_sum(key: tuple[str, int]) -> None:
    raise SharcCompileError(
        f"sharc: the gradient of parameter {key[1]} (group '{key[0]}') is combined "
        "with something other than additions before it leaves the backward graph; "
        "this is a sharc bug, please report it with the model")


def _is_sum_of(node: fx.Node, tree: set[fx.Node]) -> bool:
    """A plain add (no alpha) of two tensors, one of them in the tree."""
    return is_call(node, _ADD) and not node.kwargs and len(node.args) == 2 and all(
        isinstance(a, fx.Node) for a in node.args) and any(a in tree for a in node.args)


def _sum_nodes(reductions: list[fx.Node]) -> set[fx.Node]:
    """The reductions and every add that combines them (transitively) with
    each other or with other tensors (the local terms)."""
    tree = set(reductions)
    grew = True
    while grew:
        grew = False
        for node in list(tree):
            for user in node.users:
                if user not in tree and _is_sum_of(user, tree):
                    tree.add(user)
                    grew = True
    return tree


def _local_terms(graph: fx.Graph, tree: set[fx.Node]) -> list[fx.Node]:
    """The addends of the tree's adds that are not in the tree, each as often
    as it is added, in graph order (so every compile sums them alike)."""
    adds = [n for n in graph.nodes if n in tree and is_call(n, _ADD)]
    return [a for n in adds for a in n.args if a not in tree]


def _same_shape(term: fx.Node, reduction: fx.Node) -> bool:
    val, ref = term.meta.get("val"), reduction.meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(ref, torch.Tensor) and (
        val.shape == ref.shape and val.dtype == ref.dtype)


def _add(graph: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    node = graph.call_function(_ADD, (a, b))
    node.meta["val"] = a.meta.get("val")
    return node


def _add_local_terms(graph: fx.Graph, reduced: fx.Node, terms: list[fx.Node],
                     root: fx.Node) -> fx.Node:
    local = terms[0]
    for term in terms[1:]:
        local = _add(graph, local, term)
    result = graph.call_function(_ADD, (reduced, local))
    result.meta.update(root.meta)
    return result


def is_local_add(node: fx.Node) -> bool:
    """The add _merge leaves behind a reduction: its shard gradient plus the
    parameter's local terms, read only by the output."""
    return (is_call(node, _ADD) and is_call(node.args[0], REDUCE_SCATTER)
            and isinstance(node.args[1], fx.Node) and not is_call(node.args[1], REDUCE_SCATTER)
            and bool(node.users) and all(u.op == "output" for u in node.users))


def _lift(graph: fx.Graph, node: fx.Node, tree: set[fx.Node],
          lifted: dict[fx.Node, fx.Node]) -> fx.Node:
    """The full-gradient counterpart of a shard-gradient sum node: the sum of
    the full gradients its reductions reduce, local terms left out."""
    if node not in lifted:
        parts = [_lift(graph, a, tree, lifted) for a in node.args if a in tree]
        lifted[node] = parts[0] if len(parts) == 1 else _add(graph, *parts)
    return lifted[node]
