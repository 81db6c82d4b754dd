"""One graph through sharc's scheduler: lower to IR, run the C++ passes,
rebuild the FX graph."""

from __future__ import annotations

import itertools
import os

import torch
import torch.fx as fx

from sharc._compile.apply import rebuild
from sharc._compile.lower import lower
from sharc._compile.merge_gradients import merge_gradient_reductions
from sharc.config import CompileConfig

_graph_ids = itertools.count()


def schedule_graph(gm: fx.GraphModule, config: CompileConfig, kind: str) -> fx.GraphModule:
    """Rewrites `gm` (a forward or backward graph from AOTAutograd) in place so
    that gathers, waits, releases and reductions are explicit sharc ops."""
    if kind == "backward":
        merge_gradient_reductions(gm.graph)
    lowered = lower(gm.graph)
    if not lowered.slots:
        return gm  # nothing sharded is read here
    text, nodes, passes, trace, params = torch.classes.sharc.Scheduler.schedule_nodes(
        lowered.text,
        gather_bucket_bytes=config.gather_bucket_bytes,
        reduce_bucket_bytes=config.reduce_bucket_bytes,
        disabled_passes=list(config.disable_passes),
        trace=config.dump_ir is not None)
    if config.dump_ir is not None:
        _dump(config.dump_ir, kind, lowered.text, passes, trace, text)
    gm.graph = rebuild(gm.graph, lowered, nodes, dict(params))
    gm.graph.lint()
    gm.recompile()
    return gm


def _dump(directory: str, kind: str, before: str, passes: list[tuple[str, int, bool]],
          trace: list[tuple[str, str, str]], after: str) -> None:
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"rank{_rank()}_{next(_graph_ids):03d}_{kind}")
    with open(stem + ".before.ir", "w") as f:
        f.write(before)
    with open(stem + ".passes.ir", "w") as f:
        f.write(_passes_text(passes, trace))
    with open(stem + ".after.ir", "w") as f:
        f.write(after)


def _passes_text(passes: list[tuple[str, int, bool]], trace: list[tuple[str, str, str]]) -> str:
    """The IR before and after each pass, in pipeline order, each after-IR
    headed by the pass's rewrite count; switched-off passes get one line."""
    steps: dict[str, dict[str, str]] = {}
    for name, when, ir in trace:
        steps.setdefault(name, {})[when] = ir
    lines = []
    for name, rewrites, skipped in passes:
        if skipped:
            lines.append(f"# ---- {name} switched off\n")
            continue
        lines.append(f"# ---- before {name}\n{steps[name]['before']}\n")
        lines.append(f"# ---- after {name} ({rewrites} rewrites)\n{steps[name]['after']}\n")
    return "".join(lines)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
