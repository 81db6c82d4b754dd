"""What the benchmarks share: the model, a competitor and its training step,
warm-up and interleaved timing, exact byte accounting, and the result files.

Step time is the median over interleaved rounds (each round times a few
steps of every competitor in turn, so machine noise hits all of them
alike), after warm-up steps that include compilation. Every competitor sees
the same batches in the same order.

Peak memory per rank is exact byte accounting, in two parts:
  resident: bytes of the parameters, gradients and optimizer state a rank
            holds between steps (tensor storages, each counted once);
  step:     the highest level the CPU allocator reached above that during one
            training step (torch.profiler's memory events, summed in order).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sharc.models.gpt import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=256)
# At least 8x MODEL's parameters, in 12 layers (bench/compare.py's second size).
LARGE_MODEL = GPTConfig(vocab_size=65, block_size=128, n_layer=12, n_head=8, n_embd=512)


@dataclass
class Competitor:
    name: str
    model: torch.nn.Module
    step_fn: object
    opt: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    """Every training step's loss, in order (all competitors see the same batches)."""


def build_model(config) -> torch.nn.Module:
    """The benchmark model a config describes: the GPT, the BERT-like
    encoder, or the GPT with graph breaks in every block."""
    from _models import (BertLikeEncoder, BrokenConfig, EncoderConfig, GraphBrokenGPT, SwitchConfig,
                         SwitchLM)

    if isinstance(config, SwitchConfig):
        return SwitchLM(config)
    if isinstance(config, EncoderConfig):
        return BertLikeEncoder(config)
    if isinstance(config, BrokenConfig):
        return GraphBrokenGPT(config)
    return GPT(config)


def fresh_model(config=MODEL) -> torch.nn.Module:
    """The benchmark model, its modules given code objects of their own (see
    _with_own_code), so that what one competitor's compiler records about
    the model's code cannot change how another competitor runs."""
    torch.manual_seed(0)
    model = build_model(config)
    own_classes: dict[type, type] = {}
    for module in model.modules():
        cls = type(module)
        if cls.__module__ in (GPT.__module__, "_models"):
            if cls not in own_classes:
                own_classes[cls] = _with_own_code(cls)
            module.__class__ = own_classes[cls]
    return model


def _with_own_code(cls: type) -> type:
    """A subclass of cls whose methods run copies of cls's code objects.

    Dynamo keeps its decisions per code object, for every caller: a frame
    it gave up on (FSDP2 compiled graph-breaks in a way it cannot resume,
    and is then run uncompiled for good) and the recompile count that ends
    compiling a frame. Without a copy of its own, every competitor that
    runs after FSDP2 compiled would find GPT.forward skipped, and the
    blocks compiled one frame each until the recompile limit."""
    methods = {}
    for name, fn in vars(cls).items():
        if isinstance(fn, types.FunctionType):
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            copy.__qualname__, copy.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
            methods[name] = copy
    methods["__module__"] = cls.__module__
    return type(cls.__name__, (cls,), methods)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(c: Competitor, x, y) -> float:
    loss = c.step_fn(x, y)
    loss.backward()
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    c.losses.append(loss.item())
    return c.losses[-1]


def slug(name: str) -> str:
    """A competitor's name as a file name."""
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


@contextlib.contextmanager
def own_inductor_cache(directory: str | None):
    """Inductor's caches for one competitor's compilation: `directory` on
    disk (TORCHINDUCTOR_CACHE_DIR while the block runs) and nothing in this
    process's memory (the compiled kernels, wrappers and graphs other
    competitors' compilations left there are dropped from Inductor's
    in-memory caches first, not unloaded). None: the process's cache, as it
    is. Without this, competitors that compile the same graph (the floor and
    DDP compiled do) find each other's work cached, and the later one's
    warm-up leaves out what the earlier one paid."""
    if directory is None:
        yield
        return
    from torch._inductor.utils import clear_caches

    clear_caches()
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def cpu_seconds() -> float:
    """CPU seconds (user and system) this process and its waited-for child
    processes (Inductor's C++ compiler runs) have used: on a shared host,
    what a warm-up did, where its wall time also counts what other
    processes took from it."""
    me, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def warm_up(names: list[str], build: Callable[[str], Competitor], batch, warmup: int,
            results: dict, cache_dir: Callable[[str], str | None] = lambda name: None,
            ) -> list[Competitor]:
    """Builds each competitor and runs its warm-up steps (compilation
    included). One that cannot run gets an "error" entry in `results` and is
    left out; the others get their warm-up seconds and losses. Each
    competitor compiles with the Inductor cache directory `cache_dir(name)`
    (see own_inductor_cache; None: the process's)."""
    competitors = []
    for name in names:
        start, cpu_start = time.perf_counter(), cpu_seconds()
        try:
            steps = []
            with own_inductor_cache(cache_dir(name)):
                c = build(name)
                steps.append(time.perf_counter() - start)
                for s in range(warmup):
                    train_step(c, *batch(s))
                    steps.append(time.perf_counter() - start - sum(steps))
        except Exception:  # noqa: BLE001  (a competitor that cannot run is reported)
            traceback.print_exc()  # the table keeps one line of it
            results[name] = {"error": traceback.format_exc().strip().splitlines()[-1][:160]}
            continue
        results[name] = {"warmup_s": time.perf_counter() - start,
                         "warmup_cpu_s": cpu_seconds() - cpu_start, "losses": list(c.losses),
                         "warmup_parts_s": steps}  # the build, then each warm-up step
        competitors.append(c)
    return competitors


def time_rounds(competitors: list[Competitor], batch, args) -> dict[str, list[float]]:
    """Seconds of each timed step, per competitor: `args.rounds` rounds, each
    running `args.steps_per_round` steps of every competitor in turn on the
    batches after the warm-up ones."""
    times = {c.name: [] for c in competitors}
    for r in range(args.rounds):
        for c in competitors:
            for i in range(args.steps_per_round):
                x, y = batch(args.warmup + r * args.steps_per_round + i)
                dist.barrier()
                t0 = time.perf_counter()
                train_step(c, x, y)
                times[c.name].append(time.perf_counter() - t0)
    return times


def median_step_s(times: list[float]) -> float:
    return statistics.median(times)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(c: Competitor) -> int:
    """Parameters, gradients and optimizer state held by this rank."""
    seen, total = set(), 0
    tensors = [_local(p) for p in c.model.parameters()]
    tensors += [_local(p.grad) for p in c.model.parameters() if p.grad is not None]
    tensors += [_local(v) for s in c.opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def profiled_step(c: Competitor, x, y) -> torch.profiler.profile:
    """One training step under torch.profiler (memory events and shapes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, record_shapes=True) as prof:
        train_step(c, x, y)
    return prof


def step_peak_bytes(prof: torch.profiler.profile) -> int:
    """Highest allocator level above the starting one during the profiled step."""
    # Every allocation and free the CPU allocator reported, in order.
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return peak


_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}


def allgather_sent_bytes(prof: torch.profiler.profile, world: int) -> int:
    """Bytes this rank sent by all-gathers during the profiled step, counted
    as sharc's counters count them: (world - 1) x the input's bytes, for
    every all-gather the gloo backend ran (its "gloo:all_gather*" events,
    whoever called it)."""
    total = 0
    for e in prof.profiler.kineto_results.events():
        if e.name().startswith("gloo:all_gather"):
            for shape, dtype in zip(e.shapes(), e.dtypes()):
                if dtype not in _ITEMSIZE:
                    raise ValueError(f"all-gather of an unexpected dtype {dtype!r}")
                total += (world - 1) * _ITEMSIZE[dtype] * int(torch.Size(shape).numel())
    return total


def markdown(rows: list[dict], cols: list[str]) -> str:
    """A Markdown table of `rows` in `cols` order; a row with an "error"
    shows it in place of its figures."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r[cols[0]]} | did not run: {r['error']} |" + " |" * (len(cols) - 2))
        else:
            lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def write_results(out: str, stem: str, meta: dict, rows: list[dict], heading: str,
                  table: str) -> None:
    """out/stem.json (meta and rows) and out/stem.md (heading, meta, table)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(f"{heading} {json.dumps(meta)}\n\n{table}\n")
