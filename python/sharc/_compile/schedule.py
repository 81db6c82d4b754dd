"""One graph through sharc's scheduler: lower to IR (fx_to_ir.py), run the
C++ passes, rebuild the FX graph (ir_to_fx.py). The last of the FX
transforms in fx_pipeline.py."""

from __future__ import annotations

import functools
import itertools
import os

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

from sharc._compile.collective_costs import agreed_collective_costs
from sharc._compile.fx_to_ir import lower
from sharc._compile.ir_to_fx import rebuild
from sharc._compile.ops import BACKWARD_GRAPH, FORWARD_GRAPH
from sharc._compile.profile import profile_compute
from sharc._library import Runtime
from sharc.config import CompileConfig

_graph_ids = itertools.count()


def schedule_graph(gm: fx.GraphModule, config: CompileConfig, kind: str,
                   read_in_backward: set[tuple[str, int]] = frozenset()) -> fx.GraphModule:
    """Rewrites `gm` (a "forward", "backward" or "inference" graph from
    AOTAutograd) in place so that gathers, waits, releases and reductions
    are explicit sharc ops. `read_in_backward`: (group, parameter id) the
    backward reads, the only ones a forward graph may keep gathered."""
    lowered = lower(gm.graph)
    if not lowered.slots:
        return gm  # nothing sharded is read here
    group_name = next(iter(lowered.slots.values())).group
    runtime = Runtime.for_group(group_name)
    compute, collective = {}, []
    if config.profile:
        # Real tensors and real collectives: the compiler's fake mode and
        # Python dispatcher are off (a communication thread must never need
        # the interpreter this thread holds while it waits).
        with unset_fake_temporarily(), no_python_dispatcher():
            compute = profile_compute(gm.graph)
        collective = agreed_collective_costs(group_name, runtime, _device(lowered))
    lowered = lower(gm.graph, compute, dict(runtime.persistent_params()))
    schedule = torch.classes.sharc.Scheduler.run(
        lowered.text, config.pipeline_text(),
        _facts(config, lowered, group_name, collective, kind, read_in_backward),
        config.dump_ir is not None)
    if config.dump_ir is not None:
        _dump(config.dump_ir, kind, lowered.text, schedule)
    _keep(runtime, lowered, schedule.params)
    graph_kind = BACKWARD_GRAPH if kind == "backward" else FORWARD_GRAPH
    # Points of other graphs gather ahead beside this peak (the runtime's
    # [Note: the budget across graphs]).
    runtime.note_graph_peak(graph_kind,
                            torch.classes.sharc.Scheduler.peak_gathered_bytes(schedule.ir))
    gm.graph = rebuild(gm.graph, lowered, schedule.nodes,
                       {p: dtype for p, dtype, _ in schedule.params}, graph_kind,
                       -1 if schedule.budget is None else schedule.budget)
    gm.graph.lint()
    gm.recompile()
    return gm


def _facts(config: CompileConfig, lowered, group_name: str, collective: list[float], kind: str,
           read_in_backward):
    """What the graph is scheduled from, beyond the pipeline's settings."""
    facts = torch.classes.sharc.ScheduleFacts()
    budget = config.memory_budget_bytes
    facts.memory_budget_bytes = (default_budget(lowered, group_name, config)
                                 if budget is None else budget)
    facts.budget_is_default = budget is None
    facts.collective_costs = collective
    facts.keep_for_backward = kind == "forward"
    runtime = Runtime.for_group(group_name)
    # A gather unit's members are never kept: the unit gathers them whole,
    # forward and backward, skipping members still gathered. A graph inside
    # the unit reads only the experts this rank routed to, so a keep there
    # would leave different members gathered on each rank, and the unit's
    # backward gather would differ between ranks (the ranks diverge).
    facts.keep_candidates = [s.ir_id for s in lowered.slots.values()
                             if (s.group, s.pid) in read_in_backward
                             and not runtime.in_gather_unit(s.pid)]
    facts.replicas = runtime.replicate_size()  # hybrid sharding
    return facts


def default_budget(lowered, group_name: str, config: CompileConfig) -> int:
    """CompileConfig.memory_budget_bytes' default, by memory_budget_rule
    ("auto": "free_memory" for a CUDA parameter, "largest_param" for others,
    the rules before the host's memory was read):
    "free_memory", an eighth of the memory free on the emptiest rank at the
    group's first compile (the CUDA device's, or the host's for a CPU
    parameter: with room, the schedule keeps parameters gathered from
    forward to backward and saves their backward all-gathers);
    "largest_param", four times the largest parameter the graph reads, in
    the dtype the pipeline gathers it in (a bf16-gathered fp32 weight counts
    its bf16 bytes: in fp32 bytes the narrower graph got twice the room and
    its buckets and prefetches filled it). The scheduler raises either to
    what the graph needs at least. Every rank must get the same budget, or
    they keep different parameters and issue different collectives: free
    memory is agreed over the group (its least), once, and rounded
    (_round_budget) so that a rerun gets the same budget."""
    device = _device(lowered)
    rule = config.memory_budget_rule
    if rule == "auto":
        rule = "free_memory" if device.type == "cuda" else "largest_param"
    if rule == "largest_param":
        return 4 * torch.classes.sharc.Scheduler.largest_gathered_param_bytes(
            lowered.text, config.pipeline_text())
    return _round_budget(_agreed_free_bytes(group_name, device) // 8)


def _round_budget(budget: int) -> int:
    """`budget` rounded down to a power of two. The budget is baked into the
    compiled graphs (prefetch_next_graph's argument) and shapes the
    schedule, so it is part of their keys in Inductor's FX graph cache: read
    exactly, free memory differed by a few percent between two runs of the
    same job (2785512960 and 2884214784 bytes) and the rerun compiled
    everything anew. A power of two changes only when free memory crosses
    one: a change of a few percent moves it in about one run in twenty (a
    finer grid, in more), at the price of at most half the room; an eighth
    of free memory is a rule of thumb, not a measured need, and the
    scheduler still raises the budget to what a graph needs."""
    return 1 << (budget.bit_length() - 1) if budget > 0 else 0


def _device(lowered) -> torch.device:
    """The device of the graph's sharded parameters (the first one's)."""
    slot = next(iter(lowered.slots.values()))
    return slot.shard.meta["val"].device if slot.shard is not None else torch.device("cpu")


@functools.cache
def _agreed_free_bytes(group_name: str, device: torch.device) -> int:
    """The least free memory of `device` (a CUDA device, or the host) over
    the group's ranks, measured once per group: at its first compile, which
    every rank runs (a recompile on some ranks only finds it cached and
    issues no collective)."""
    with unset_fake_temporarily(), no_python_dispatcher():  # a real collective
        on_cuda = device.type == "cuda"
        local = torch.cuda.mem_get_info(device)[0] if on_cuda else host_free_bytes()
        free = torch.tensor([local], dtype=torch.int64,
                            device=device if on_cuda else torch.device("cpu"))
        if dist.is_initialized():
            group = torch._C._distributed_c10d._resolve_process_group(group_name)
            dist.all_reduce(free, op=dist.ReduceOp.MIN, group=group)
        return int(free.item())


def host_free_bytes() -> int:
    """The host memory available to new allocations without swapping:
    Linux's MemAvailable (free pages plus what the kernel can reclaim, page
    cache included), else the free physical pages; within a cgroup's limit
    (a container), at most the room left under it."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo = _read("/proc/meminfo")
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024  # reported in kB
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit.strip().isdigit() and used.strip().isdigit():
        free = min(free, max(0, int(limit) - int(used)))
    return free


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _keep(runtime, lowered, params) -> None:
    """Parameters the schedule keeps gathered become persistent in the
    runtime: gathered once per step, released never, so the backward and
    the next graphs find them gathered (and lower them as kept)."""
    for ir_id, _, kept in params:
        slot = lowered.slots.get(ir_id)  # None: kept elsewhere, not read here
        if kept and slot is not None and not runtime.is_persistent(slot.pid):
            runtime.set_persistent(slot.pid, True)


def _dump(directory: str, kind: str, before: str, schedule) -> None:
    """The graph's IR before the passes, each pass's before and after (with
    its statistics), the scheduled IR, and the pipeline that ran, every
    argument written out: `sharc-opt STEM.before.ir --pipeline-file
    STEM.pipeline` replays the schedule."""
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"rank{_rank()}_{next(_graph_ids):03d}_{kind}")
    with open(stem + ".before.ir", "w") as f:
        f.write(before)
    with open(stem + ".passes.ir", "w") as f:
        f.write(_passes_text(schedule.passes, schedule.trace))
    with open(stem + ".after.ir", "w") as f:
        f.write(schedule.ir)
    with open(stem + ".pipeline", "w") as f:
        f.write(schedule.pipeline + "\n")


def _passes_text(passes, trace: list[tuple[str, str, str]]) -> str:
    """The IR before and after each pass, in pipeline order, each after-IR
    headed by the pass's statistics; switched-off passes get one line."""
    steps: dict[str, dict[str, str]] = {}
    for name, when, ir in trace:
        steps.setdefault(name, {})[when] = ir
    lines = []
    for name, skipped, stats in passes:
        if skipped:
            lines.append(f"# ---- {name} switched off\n")
            continue
        counts = ", ".join(f"{k}={v}" for k, v in sorted(stats.items()))
        lines.append(f"# ---- before {name}\n{steps[name]['before']}\n")
        lines.append(f"# ---- after {name} ({counts})\n{steps[name]['after']}\n")
    return "".join(lines)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
