"""Joint-graph pass: the partitioner must recompute gathered parameters in
backward, never save them.

Marking every all_gather (and every view, cast or copy of its output)
MUST_RECOMPUTE makes
AOTAutograd's partitioner place a fresh all_gather in the backward graph that
reads the shard, so the forward hands backward only shards. sharc's passes
then schedule both graphs' gathers and releases; the IR verifier rejects a
backward graph that still receives a full parameter.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from sharc._compile.ops import ALL_GATHER, is_call, is_view

_COPIES = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
           torch.ops.aten.clone.default, torch.ops.aten.alias.default}


def _derives_value(node: fx.Node) -> bool:
    """A view, cast or copy: its output is the input's values (autocast's
    downcast of a weight is one), so backward can recompute it."""
    return is_view(node) or (node.op == "call_function" and node.target in _COPIES)


def mark_gathers_for_recompute(graph: fx.Graph) -> int:
    """Tags gathers and their views, casts and copies; returns how many nodes
    were tagged."""
    gathered: set[fx.Node] = set()
    for node in graph.nodes:
        if is_call(node, ALL_GATHER) or (_derives_value(node) and node.args
                                         and node.args[0] in gathered):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            gathered.add(node)
    return len(gathered)


class RecomputeGathers(CustomGraphPass):
    """The pass in the form Inductor's `joint_custom_post_pass` hook takes (after Inductor's own joint-graph
    rewrites, which may replace tagged view nodes, and right before partitioning)."""

    def __call__(self, graph: fx.Graph) -> None:
        mark_gathers_for_recompute(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))
