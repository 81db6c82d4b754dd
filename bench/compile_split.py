"""Where a compiled competitor's first step (compilation included) goes:
Dynamo's tracing, AOTAutograd, sharc's FX pipeline (within it the compute
profiling, the collective probe and the C++ scheduler), Inductor's lowering
and code generation, and the wait for Inductor's C++ kernel builds.

    .venv/bin/python bench/compile_split.py --size small
    .venv/bin/python bench/compile_split.py --size small --competitor "DDP compiled"

The competitor is built as bench/compare.py builds it, alone in fresh
processes (no other competitor's graphs in Dynamo's, AOTAutograd's or
Inductor's in-memory caches). Inductor's on-disk caches are whatever
TORCHINDUCTOR_CACHE_DIR holds: an empty directory charges every C++ kernel
build to this step, a directory a run of the same competitor filled shows
the warm start. The table says which it was (cold: the directory was empty
or absent when the run began).

sharc's functions are wrapped with timers in every rank before the model
compiles; the torch parts are torch's own compile-time counters
(torch._dynamo.utils.compilation_time_metrics, one entry per timed
function, nested ones included in their callers). Rank 0's seconds are
printed and written to bench/results/compile_split_<size>[_<competitor>].{json,md}.
With --first-compile, a small model is compiled first (compare.py's
_first_compile), so the first step leaves out what a process pays once.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import torch
import torch.distributed as dist

import sharc
import sharc._compile.fx_pipeline as fx_pipeline
import sharc._compile.schedule as schedule
from _common import markdown, own_inductor_cache, train_step, write_results
from compare import SIZES, _build, _first_compile
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch

_SECONDS: dict[str, float] = {}
_SHARC = "sharc's FX pipeline (all of it)"

# torch's compile-time counters shown, as (label, counter names summed). Each
# name is a function torch times; nested ones are inside their callers.
_TORCH_PARTS = [
    ("Dynamo compile, all of it (backend included)", ("_compile.compile_inner",)),
    ("  backend call (AOTAutograd, sharc, Inductor)", ("OutputGraph.call_user_compiler",)),
    ("    AOTAutograd tracing (joint graph)", ("aot_trace_joint_graph",)),
    ("    Inductor, per graph (compile_fx_inner)", ("compile_fx_inner",)),
    ("      Inductor lowering (GraphLowering.run)", ("GraphLowering.run",)),
    ("      Inductor scheduling and fusion", ("Scheduler.__init__",)),
    ("      Inductor code generation", ("GraphLowering.codegen",)),
    ("      loading the generated module (kernel builds waited for)",
     ("PyCodeCache.load_by_key_path",)),
    ("      C++ kernel builds in this process", ("compile_file",)),
    ("    async kernel builds waited for", ("async_compile.wait",)),
]


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _SECONDS[label] = _SECONDS.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


class _TimedRuntime:
    """schedule.Runtime's stand-in: the group's runtime, its collective
    probe timed."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def collective_costs(self):
        start = time.perf_counter()
        try:
            return self._runtime.collective_costs()
        finally:
            label = "  collective probe (once per group)"
            _SECONDS[label] = _SECONDS.get(label, 0.0) + time.perf_counter() - start


class _RuntimeClass:
    def __init__(self, cls):
        self._cls = cls

    def __getattr__(self, name):
        return getattr(self._cls, name)

    def for_group(self, group_name):
        return _TimedRuntime(self._cls.for_group(group_name))


def _instrument() -> None:
    _timed(fx_pipeline, "run", _SHARC)
    _timed(schedule, "profile_compute", "  compute profiling")
    _timed(schedule, "rebuild", "  rebuilding the FX graph")
    schedule.Runtime = _RuntimeClass(schedule.Runtime)


def _rank_main(args, cold: bool) -> None:
    configure_threads(dist.get_world_size())  # [Note: one thread for gloo's threads]
    from torch._dynamo.utils import compilation_time_metrics

    if args.competitor.startswith("sharc"):
        _instrument()
    if args.first_compile:
        with tempfile.TemporaryDirectory() as tmp, own_inductor_cache(tmp):
            _first_compile()
        from torch._dynamo.utils import counters

        compilation_time_metrics.clear()  # the competitor's alone from here
        counters.clear()
    config = SIZES[args.size]
    data = CharDataset()
    build_start = time.perf_counter()
    c = _build(args.competitor, config)
    built = time.perf_counter() - build_start
    x, y = data.rank_batch(0, args.batch, config.block_size, dist.get_rank(),
                           dist.get_world_size())
    start = time.perf_counter()
    train_step(c, x, y)
    first = time.perf_counter() - start
    x, y = data.rank_batch(1, args.batch, config.block_size, dist.get_rank(),
                           dist.get_world_size())
    start = time.perf_counter()
    train_step(c, x, y)
    second = time.perf_counter() - start
    if dist.get_rank() != 0:
        return
    rows = [{"part": "building the competitor (shard, DDP, process group)",
             "seconds": round(built, 2)},
            {"part": "first step", "seconds": round(first, 2)},
            {"part": "second step (compiled, no compilation)", "seconds": round(second, 2)}]
    for label, names in _TORCH_PARTS:
        total = sum(sum(compilation_time_metrics.get(n, [])) for n in names)
        if any(n in compilation_time_metrics for n in names):
            rows.append({"part": label, "seconds": round(total, 2)})
    rows += [{"part": k, "seconds": round(v, 2)} for k, v in _SECONDS.items()]
    from torch._dynamo.utils import counters

    hits = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    rows += [{"part": f"Inductor FX graph cache: {k.removeprefix('fxgraph_cache_')} (graphs)",
              "seconds": v} for k, v in sorted(hits.items())]
    table = markdown(rows, ["part", "seconds"])
    load = os.getloadavg()
    meta = {"size": args.size, "competitor": args.competitor, "model": repr(config),
            "world_size": dist.get_world_size(), "torch": torch.__version__, "device": "cpu",
            "backend": "gloo",
            "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default"),
            "inductor_cache_cold": cold, "first_compile": args.first_compile, "load_average": [round(v, 2) for v in load],
            "torch_counters": {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}}
    print(f"\n{args.size}, {args.competitor} (cold cache: {cold}, load {load[0]:.1f})\n{table}")
    stem = f"compile_split_{args.size}"
    if args.competitor != "sharc compiled":
        stem += "_" + args.competitor.replace(" ", "_").replace(",", "").replace("'", "")
    write_results(args.out, stem, meta, rows,
                  f"{args.competitor}'s first step, rank 0 (seconds; indented parts are "
                  "inside the part above them).", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--competitor", default="sharc compiled",
                        choices=["sharc compiled", "sharc compiled, profiling off",
                                 "DDP compiled", "floor"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--first-compile", action="store_true",
                        help="compile a small model first, in a cache of its own (compare.py's "
                        "_first_compile), so the first step leaves out what a process pays at "
                        "its first compilation")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cold = cache is not None and (not os.path.isdir(cache) or not os.listdir(cache))
    launch(_rank_main, 2, args=(args, cold))


if __name__ == "__main__":
    main()
