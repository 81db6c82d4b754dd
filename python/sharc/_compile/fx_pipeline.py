"""The FX transforms the "sharc" backend runs, by name, in the order it runs them.

One frame that Dynamo captured passes through three kinds of graph on its
way to Inductor (or to plain FX execution), and every transform names the
kinds it rewrites:

- "dynamo": Dynamo's graph of the frame, once, before AOTAutograd sees it;
- "joint": AOTAutograd's joint forward-and-backward graph of a training
  frame, right before partitioning (Inductor's `joint_custom_post_pass`
  hook, after Inductor's own joint-graph rewrites; without Inductor, sharc's
  partition function);
- "forward", "backward", "inference": each graph AOTAutograd hands on. The
  last transform of each is sharc's scheduler (schedule.py: the graph
  lowered to IR by fx_to_ir.py, the C++ passes, the FX graph rebuilt from
  the scheduled IR by ir_to_fx.py).

Every transform rewrites its graph in place. `run(kind, graph, compilation)`
runs, in PIPELINE's order, those that rewrite `kind`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from sharc._compile.escaping import copy_escaping_gathers
from sharc._compile.in_place_writes import refuse_writes_to_gathered
from sharc._compile.merge_gradients import merge_gradient_reductions
from sharc._compile.recompute import mark_gathers_for_recompute, read_in_backward
from sharc._compile.schedule import schedule_graph
from sharc._compile.sparse_gradients import densify_sparse_gradients
from sharc.config import CompileConfig

SCHEDULED = ("forward", "backward", "inference")
"""The graphs AOTAutograd hands on, each scheduled by sharc."""


@dataclass
class Compilation:
    """What the transforms of one frame's graphs share."""

    config: CompileConfig
    # (group, parameter id) of every parameter the backward reads: recorded
    # from the joint graph, the only ones a forward graph may keep gathered.
    read_in_backward: set[tuple[str, int]] = field(default_factory=set)


@dataclass(frozen=True)
class Transform:
    name: str
    kinds: tuple[str, ...]  # the graphs it rewrites
    run: Callable[[fx.GraphModule | fx.Graph, Compilation, str], None]


def _graph(g: fx.GraphModule | fx.Graph) -> fx.Graph:
    return g.graph if isinstance(g, fx.GraphModule) else g


def _record_backward_reads(graph: fx.Graph, c: Compilation, _kind: str) -> None:
    c.read_in_backward |= read_in_backward(graph)


def _schedule(gm: fx.GraphModule, c: Compilation, kind: str) -> None:
    schedule_graph(gm, c.config, kind, c.read_in_backward)


PIPELINE: tuple[Transform, ...] = (
    # Writes in place to a gathered parameter never reach the shards: refused.
    Transform("refuse_writes_to_gathered", ("dynamo",),
              lambda gm, c, kind: refuse_writes_to_gathered(gm)),
    # Sparse gradients (nn.Embedding(sparse=True)) built dense.
    Transform("densify_sparse_gradients", ("joint",),
              lambda graph, c, kind: densify_sparse_gradients(graph)),
    Transform("record_backward_reads", ("joint",), _record_backward_reads),
    # The partitioner recomputes gathers in backward instead of saving them.
    Transform("mark_gathers_for_recompute", ("joint",),
              lambda graph, c, kind: mark_gathers_for_recompute(graph)),
    # Gathered values the caller gets back become copies. Training graphs
    # are rewritten in the joint graph, inference graphs here.
    Transform("copy_escaping_gathers", ("joint", "inference"),
              lambda g, c, kind: copy_escaping_gathers(_graph(g))),
    # One reduction per parameter gradient.
    Transform("merge_gradient_reductions", ("backward",),
              lambda gm, c, kind: merge_gradient_reductions(gm.graph)),
    # Gathers, waits, releases and reductions placed by the C++ passes.
    Transform("schedule", SCHEDULED, _schedule),
)


def run(kind: str, graph: fx.GraphModule | fx.Graph, compilation: Compilation) -> None:
    """Runs, in order, every transform of PIPELINE that rewrites `kind`
    graphs on `graph` (a GraphModule, or the joint graph's fx.Graph)."""
    for transform in PIPELINE:
        if kind in transform.kinds:
            transform.run(graph, compilation, kind)


class JointGraphPass(CustomGraphPass):
    """The "joint" transforms in the form Inductor's `joint_custom_post_pass`
    hook takes."""

    def __init__(self, compilation: Compilation, key_extra: str = "") -> None:
        self.compilation = compilation
        self.key_extra = key_extra

    def __call__(self, graph: fx.Graph) -> None:
        run("joint", graph, self.compilation)

    def keyed(self, extra: str) -> "JointGraphPass":
        """The same pass, its uuid (so the FX graph cache key of a graph
        compiled under it) also carrying `extra`: a fact that changes what
        Inductor makes of a graph but that Inductor's key leaves out."""
        return JointGraphPass(self.compilation, extra)

    def uuid(self):
        """Part of Inductor's FX graph cache key: what of sharc decides the
        joint graph and what Inductor makes of sharc's ops (their lowering,
        and the C++ library that registers them with their meta kernels);
        see [Note: sharc and Inductor's caches] in backend.py."""
        from sharc import _library
        from sharc._compile import (escaping, inductor_lowerings, ops, recompute,
                                    sparse_gradients)

        files = get_hash_for_files((__file__, escaping.__file__, ops.__file__,
                                    recompute.__file__, sparse_gradients.__file__,
                                    inductor_lowerings.__file__, str(_library._LIBRARY)))
        return files + self.key_extra.encode() if self.key_extra else files
