"""Joint-graph pass: the partitioner must recompute gathered parameters in
backward, never save them.

Marking every all_gather (and every view, cast or copy of its output)
MUST_RECOMPUTE makes
AOTAutograd's partitioner place a fresh all_gather in the backward graph that
reads the shard, so the forward hands backward only shards. sharc's passes
then schedule both graphs' gathers and releases; the IR verifier rejects a
backward graph that still receives a full parameter. The joint-graph
transforms and their order are fx_pipeline.py's.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from sharc._compile.ops import ALL_GATHER, is_call, is_view, param_key

_COPIES = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
           torch.ops.aten.clone.default, torch.ops.aten.alias.default}


def _derives_value(node: fx.Node) -> bool:
    """A view, cast or copy: its output is the input's values (autocast's
    downcast of a weight is one), so backward can recompute it."""
    return is_view(node) or (node.op == "call_function" and node.target in _COPIES)


def mark_gathers_for_recompute(graph: fx.Graph) -> int:
    """Tags gathers and their views, casts and copies MUST_RECOMPUTE, and
    the forward nodes that compute with them MUST_SAVE (see
    [Note: parameters read in backward]); returns how many gathers and
    derived nodes were tagged."""
    gathered: set[fx.Node] = set()
    for node in graph.nodes:
        if is_call(node, ALL_GATHER) or (_derives_value(node) and node.args
                                         and node.args[0] in gathered):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            # A gather traced in one checkpointed region and read in a later
            # one (a block called twice, each call checkpointed: both calls
            # read the one gather the joint graph holds) would be
            # turned into MUST_SAVE by the partitioner's cleanup of region
            # boundaries, which compares the regions' ids: without one, the
            # gather stays recomputed wherever it is read.
            node.meta.pop("ac_graph_id", None)
            gathered.add(node)
    backward = _backward_nodes(graph)
    for node in graph.nodes:
        if (node not in gathered and node not in backward and "recompute" not in node.meta
                and _one_tensor(node) and any(a in gathered for a in node.all_input_nodes)):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return len(gathered)


def _one_tensor(node: fx.Node) -> bool:
    """A node whose output is one tensor: the partitioner saves tensors, not
    the tuples of a multi-output op (whose `getitem`s it saves instead)."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)


# [Note: parameters read in backward]
# Which parameters a backward graph reads decides which it gathers again,
# and every rank must gather the same ones. Gradient formulas read a
# parameter structurally (a matmul's input gradient reads its weight); but
# the partitioner also chooses, from the tensors' sizes, which forward
# values backward recomputes instead of loading them saved, and recomputing
# `x * ln.weight + ln.bias` reads the weight and bias. So ranks whose
# inputs differ in size (a last batch of one, a sequence of one token:
# size-1 dimensions compile graphs of their own) could gather different
# parameters in backward and part. The forward nodes that compute with a
# gathered value are therefore never recomputed: backward loads what they
# produced, and reads a parameter only where a gradient formula does. A
# region the user checkpointed keeps its own policy (the same on every
# rank), and the gathers themselves are still recomputed, never saved.


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward part: every node that depends on an
    incoming gradient (a `tangents` input)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in node.name) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def read_in_backward(graph: fx.Graph) -> set[tuple[str, int]]:
    """(group, parameter id) of every parameter the backward part of a joint
    graph reads: a gather (or a view, cast or copy of it) with a user that
    depends on an incoming gradient (a `tangents` input). Only these are
    worth keeping gathered from forward to backward."""
    backward = _backward_nodes(graph)
    read = set()
    for node in graph.nodes:
        if not is_call(node, ALL_GATHER):
            continue
        derived, frontier = {node}, [node]
        while frontier:
            for user in frontier.pop().users:
                if user in backward:
                    read.add(param_key(node))
                elif _derives_value(user) and user not in derived:
                    derived.add(user)
                    frontier.append(user)
    return read
