"""Sparse gradients in a joint graph become dense before their reduction.

`nn.Embedding(sparse=True)` makes autograd build its weight's gradient as a
sparse COO tensor; sharc reduce-scatters dense gradients into dense shards,
so the joint graph converts it with `_to_dense`, which Inductor cannot
compile. The pair `_to_dense(_sparse_coo_tensor_with_dims_and_tensors(...))`
is the dense gradient itself, built directly: zeros with the rows of the
values added at their indices (duplicates summed, as the sparse tensor's
coalescing would). `nn.EmbeddingBag(sparse=True)` builds its sparse
gradient in one operator, `_embedding_bag_backward(..., sparse=True)`:
its `_to_dense` becomes the same call with `sparse=False`, which computes
the dense gradient itself. Eager sharc densifies in the gather's backward
instead.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_SPARSE = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default
_TO_DENSE = torch.ops.aten._to_dense.default
_FULL = torch.ops.aten.full.default  # aten.zeros is decomposed before this pass runs
_SELECT = torch.ops.aten.select.int
_INDEX_PUT = torch.ops.aten.index_put.default
_BAG_BACKWARD = torch.ops.aten._embedding_bag_backward.default
_BAG_SPARSE_ARG = 9  # (grad, indices, offsets, offset2bag, bag_size, maximum_indices,
#                      num_weights, scale_grad_by_freq, mode, sparse, ...)


def densify_sparse_gradients(graph: fx.Graph) -> int:
    """Rewrites each `_to_dense` of a sparse COO tensor built in the graph;
    returns how many."""
    rewritten = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _TO_DENSE):
            continue
        sparse = node.args[0]
        if isinstance(sparse, fx.Node) and sparse.target is _BAG_BACKWARD:
            _densify_bag_backward(graph, node, sparse)
            rewritten += 1
            continue
        if not (isinstance(sparse, fx.Node) and sparse.target is _SPARSE):
            continue
        sparse_dim, _, size, indices, values = sparse.args[:5]
        dense = node.meta.get("val")
        with graph.inserting_before(node):
            zeros = _call(graph, _FULL, (list(size), 0.0),
                          {"dtype": values.meta["val"].dtype,
                           "device": values.meta["val"].device})
            rows = [_call(graph, _SELECT, (indices, 0, d)) for d in range(sparse_dim)]
            put = _call(graph, _INDEX_PUT, (zeros, rows, values, True))
        if dense is not None:
            put.meta["val"] = dense
        node.replace_all_uses_with(put)
        graph.erase_node(node)
        if not sparse.users:
            graph.erase_node(sparse)
        rewritten += 1
    return rewritten


def _densify_bag_backward(graph: fx.Graph, to_dense: fx.Node, bag: fx.Node) -> None:
    args, kwargs = list(bag.args), dict(bag.kwargs)
    if len(args) > _BAG_SPARSE_ARG:
        args[_BAG_SPARSE_ARG] = False
    else:
        kwargs["sparse"] = False
    with graph.inserting_before(to_dense):
        dense = graph.call_function(_BAG_BACKWARD, tuple(args), kwargs)
    dense.meta.update(to_dense.meta)  # the dense gradient's value, as _to_dense gave it
    to_dense.replace_all_uses_with(dense)
    graph.erase_node(to_dense)
    if not bag.users:
        graph.erase_node(bag)


def _call(graph: fx.Graph, target, args, kwargs=None) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    vals = [a.meta["val"] if isinstance(a, fx.Node) else
            [x.meta["val"] for x in a] if isinstance(a, list) and a and
            isinstance(a[0], fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **(kwargs or {}))
    return node
