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

Graphs are counted by Dynamo frame: a graph break resumes in a frame of
its own, while a recompile of a frame (a guard failed) replaces a graph
rather than adding one, so it is not counted. The count is the same on
every rank that runs the same code; the warning issues no collective.
"""

from __future__ import annotations

import itertools
import warnings

from sharc.config import CompileConfig


class ManyGraphsWarning(UserWarning):
    """Graph breaks split a sharded model's step into many compiled graphs."""


class _GroupGraphs:
    """The Dynamo frames compiled with gathers from one group, and whether
    the warning was given."""

    def __init__(self):
        self.frames: set[int] = set()
        self.warned = False


_GROUPS: dict[str, _GroupGraphs] = {}
_OUTSIDE_DYNAMO = itertools.count(-1, -1)  # ids for graphs compiled outside a Dynamo frame


def note_compiled_graph(group_name: str, config: CompileConfig, runtime) -> None:
    """Counts the graph being compiled (it gathers from `group_name`) and
    warns once when the group's graphs reach config.warn_graphs."""
    state = _GROUPS.setdefault(group_name, _GroupGraphs())
    state.frames.add(_frame_id())
    threshold = config.warn_graphs
    if state.warned or threshold is None or len(state.frames) < threshold:
        return
    state.warned = True
    warnings.warn(_message(len(state.frames), config, runtime), ManyGraphsWarning, stacklevel=2)


def _frame_id() -> int:
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    # Outside Dynamo (a backend called by hand): each call its own graph.
    return compile_id.frame_id if compile_id is not None else next(_OUTSIDE_DYNAMO)


def _message(graphs: int, config: CompileConfig, runtime) -> str:
    head = (f"sharc: graph breaks split this model's step into {graphs} compiled graphs "
            f"that read sharded parameters. Each graph gathers and reduces on its own: "
            f"per step at least one all-gather in forward, one in backward (unless its "
            f"parameters stay gathered) and one reduce-scatter")
    if config.profile:  # measured at the group's first compile (cached: no collective here)
        ag_us, _, rs_us, _ = runtime.collective_costs()
        floor_ms = graphs * (2 * ag_us + rs_us) / 1e3
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
