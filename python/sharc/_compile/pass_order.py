"""Where a forward pass begins, for cross-graph prefetch.

The runtime starts the next compiled graph's first gather at the end of the
graph before it, in the order it recorded (see [Note: cross-graph prefetch]
in src/runtime/runtime_graph_prefetch.cpp). That order must stay within one
forward pass: between two forward calls with no backward in between (an
evaluation loop, a forward dropped without backward) a bucket gathered ahead
would stay gathered in the user's hands. A compiled forward graph continues
the pass when it reads a tensor a forward graph of the pass returned, or one
eager code computed from it at the graph break; any other graph starts a new
pass, and so does the first after a backward. The runtime checks that
(Runtime::begin_forward_graph, [Note: forward dataflow]) from the tensors
this wrapper around each compiled forward hands it before and after the
call, so every rank decides alike from the same dataflow.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from sharc._compile.graph_breaks import counter_for
from sharc._compile.ops import START_GATHER, is_call
from sharc._library import Runtime
from sharc.config import CompileConfig


def gathered_group(graph: fx.Graph) -> str | None:
    """The process group a scheduled graph gathers from; None without gathers."""
    for node in graph.nodes:
        if is_call(node, START_GATHER):
            return str(node.args[1])
    return None


def in_pass_order(compiled, groups: list[str], config: CompileConfig):
    """`compiled` (what a torch.compile backend returns for one Dynamo graph,
    called with the graph's inputs) telling the runtime of `groups[0]` what
    it reads and returns, so the runtime knows where forward passes begin
    (and the many-graphs warning counts graphs per pass, while it counts);
    `compiled` itself when the graph gathers nothing."""
    if not groups:
        return compiled
    group = groups[0]
    counter = counter_for(group, config)

    def run(*args):
        runtime = Runtime.for_group(group)
        inputs = [t for t in args if isinstance(t, torch.Tensor)]
        runtime.begin_forward_graph(inputs)
        out = compiled(*args)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        runtime.end_forward_graph(outputs)
        if counter.active:
            counter.ran(inputs, outputs)
        return out

    return run
