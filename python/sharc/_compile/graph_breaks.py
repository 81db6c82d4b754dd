"""A warning, once per process group, when graph breaks split a sharded
model's step into many compiled graphs.

Each compiled graph schedules only what it reads: its gathers are bucketed
and its gradients reduced within the graph, so every graph that reads
sharded parameters pays at least one forward all-gather, one backward
all-gather (unless its parameters are kept gathered) and one
reduce-scatter per step, each costing the collective's latency whatever
its size, plus Dynamo's guards and the Python between graphs. A step split
into many small graphs can then be slower compiled than eager (measured
in bench/results/compare_switch.md: a SwitchTransformers model).

Graphs are counted as they run, per forward pass, by the rule the runtime
uses for cross-graph prefetch (_compile/pass_order.py): a compiled forward
graph continues the pass when it reads a tensor the previous one returned.
Counting at compile time would miss most graphs: the blocks of a model
share their code, so one compiled graph (and its resume functions after a
break) serves every block. Every rank counts alike from the same
dataflow; the warning issues no collective. Counting stops once it has
warned or after a few passes, so a step pays nothing for it after that.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from sharc._compile.collective_costs import known_collective_costs
from sharc.config import CompileConfig


class ManyGraphsWarning(UserWarning):
    """Graph breaks split a sharded model's step into many compiled graphs."""


_PASSES_WATCHED = 3  # forward passes counted before counting stops


class GraphCounter:
    """Compiled forward graphs per forward pass of one group, until it has
    warned or watched _PASSES_WATCHED passes."""

    def __init__(self, config: CompileConfig, group_name: str):
        self.config = config
        self.group_name = group_name
        self.active = config.warn_graphs is not None
        self.passes = 0
        self.graphs = 0  # in the current pass
        self.returned: list[weakref.ref] = []  # the last graph's outputs

    def ran(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """A compiled forward graph read `inputs` and returned `outputs`."""
        continues = any(ref() is t for ref in self.returned for t in inputs)
        self.returned = [weakref.ref(t) for t in outputs]
        if continues:
            self.graphs += 1
        else:
            self.passes += 1
            self.graphs = 1
            if self.passes > _PASSES_WATCHED:
                self.active = False
                return
        if self.graphs >= self.config.warn_graphs:
            self.active = False
            warnings.warn(_message(self.graphs, self.config, self.group_name), ManyGraphsWarning,
                          stacklevel=3)


_COUNTERS: dict[str, GraphCounter] = {}


def counter_for(group_name: str, config: CompileConfig) -> GraphCounter:
    """The group's counter (the first compile's config sets the threshold)."""
    if group_name not in _COUNTERS:
        _COUNTERS[group_name] = GraphCounter(config, group_name)
    return _COUNTERS[group_name]


def _message(graphs: int, config: CompileConfig, group_name: str) -> str:
    head = (f"sharc: graph breaks split this model's forward pass into at least {graphs} "
            f"compiled graphs that read sharded parameters (its backward into as many). Each "
            f"graph gathers and reduces on its own: "
            f"per step at least one all-gather in forward, one in backward (unless its "
            f"parameters stay gathered) and one reduce-scatter")
    costs = known_collective_costs(group_name)  # agreed at the group's first compile
    if config.profile and costs is not None:
        ag_us, _, rs_us, _ = costs
        floor_ms = graphs * (ag_us + rs_us) / 1e3  # the backward gather may be kept away
        head += (f", measured at {ag_us:.0f} us latency per all-gather and {rs_us:.0f} us per "
                 f"reduce-scatter: at least {floor_ms:.1f} ms per step in collective latency "
                 f"alone")
    return (head + ", plus Dynamo's guards and the Python between graphs. Compiled may then "
            "be slower than eager. To avoid it, remove the graph breaks "
            "(torch._dynamo.explain(model)(*inputs) lists them), or run the model eagerly "
            "(sharc.shard without torch.compile); a memory_budget_bytes with room keeps "
            "parameters gathered and saves the backward all-gathers. "
            f"CompileConfig.warn_graphs={config.warn_graphs} sets when this warns "
            "(None: never).")
