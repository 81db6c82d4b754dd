"""The same training step's Python functions, side by side: DDP compiled and
sharc compiled (or any of compare.py's competitors), in one run, on the
same ranks and batches.

    .venv/bin/python bench/py_profile.py --size switch
    .venv/bin/python bench/py_profile.py --size small --competitors floor "sharc compiled"

op_compare.py groups torch's operators; on a model that breaks into many
graphs much of the step is Python around them (the model's eager code at
the breaks, Dynamo's frame entries, the compiled graphs' wrappers, sharc's
hooks), which the operator profile does not name. Here each competitor
(built as compare.py builds it) trains `--warmup` steps, then `--steps`
steps run under cProfile; rank 0's own time per step (cProfile's tottime:
time in a function less the Python functions it called, so a C++ call made
from a Python function, a blocking wait among them, counts to that
function) is summed per function, and the functions are listed by how much
more time the last competitor spends in them than the first.

cProfile adds a fixed cost to every Python call, so a step of many small
calls reads slower than it runs; the unprofiled step is printed beside.
The figures are shares for finding where the time goes, not step times:
compare.py measures those.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import os
import pstats
import time

import torch
import torch.distributed as dist

from _common import markdown, train_step, write_results
from compare import COMPETITORS, SIZES, _build
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch


def _where(filename: str, line: int, function: str) -> str:
    if filename == "~":  # a C function: its name says it
        return function
    if "/python/sharc/" in filename:  # sharc's own package, named so
        filename = "sharc/" + filename.split("/python/sharc/", 1)[1]
    elif "/site-packages/" in filename:
        filename = filename.split("/site-packages/", 1)[1]
    else:
        filename = os.path.basename(filename)
    return f"{filename}:{line}({function})"


def _measure(name: str, config, batch, args) -> dict:
    c = _build(name, config)
    for step in range(args.warmup):
        train_step(c, *batch(step))
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        train_step(c, *batch(args.warmup + step))
    step_ms = (time.perf_counter() - start) * 1e3 / args.steps
    dist.barrier()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for step in range(args.steps):
        train_step(c, *batch(args.warmup + args.steps + step))
    profile.disable()
    profiled_ms = (time.perf_counter() - start) * 1e3 / args.steps
    own, calls = collections.Counter(), collections.Counter()
    for (filename, line, function), (_, ncalls, tottime, _, _) in \
            pstats.Stats(profile).stats.items():
        key = _where(filename, line, function)
        own[key] += tottime * 1e3 / args.steps
        calls[key] += ncalls / args.steps
    dist.barrier()
    return {"step_ms": step_ms, "profiled_ms": profiled_ms, "own": own, "calls": calls}


def _rank_main(args) -> None:
    configure_threads(dist.get_world_size())  # [Note: one thread for gloo's threads]
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SIZES[args.size]
    data = CharDataset()

    def batch(step):
        return data.rank_batch(step, args.batch, config.block_size, rank, world)

    measured = {name: _measure(name, config, batch, args) for name in args.competitors}
    if rank == 0:
        _report(measured, args, config)


def _report(measured: dict, args, config) -> None:
    first, last = args.competitors[0], args.competitors[-1]
    a, b = measured[first], measured[last]
    rows = [{"function": label, f"{first} ms": round(a[key], 2), f"{last} ms": round(b[key], 2),
             "calls": "", f"{last} - {first} ms": round(b[key] - a[key], 2)}
            for label, key in (("step, unprofiled", "step_ms"),
                               ("step, under cProfile", "profiled_ms"))]
    keys = set(a["own"]) | set(b["own"])
    for key in sorted(keys, key=lambda k: a["own"][k] - b["own"][k])[:args.top]:
        rows.append({"function": key, f"{first} ms": round(a["own"][key], 2),
                     f"{last} ms": round(b["own"][key], 2),
                     "calls": f"{a['calls'][key]:.0f} / {b['calls'][key]:.0f}",
                     f"{last} - {first} ms": round(b["own"][key] - a["own"][key], 2)})
    sharc_own = sum(ms for key, ms in b["own"].items() if key.startswith("sharc/"))
    table = markdown(rows, list(rows[0]))
    meta = {"size": args.size, "model": repr(config), "world_size": dist.get_world_size(),
            "batch_per_rank": args.batch, "steps": args.steps, "torch": torch.__version__,
            "device": "cpu", "backend": "gloo"}
    heading = (f"Python functions' own time per step (cProfile tottime), rank 0, {last} against "
               f"{first}: the {args.top} functions {last} spends the most more time in.")
    print(f"\n{args.size}: {heading}\n{table}")
    print(f"\n{last}: own time in functions of sharc's Python package: {sharc_own:.2f} ms a step")
    write_results(args.out, f"py_profile_{args.size}", meta, rows, heading, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", choices=list(SIZES), default="switch")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--competitors", nargs=2, default=["DDP compiled", "sharc compiled"],
                        choices=COMPETITORS, metavar="NAME",
                        help="two of compare.py's competitor names; the second is set against "
                             "the first")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    start = time.perf_counter()
    launch(_rank_main, args.nproc, args=(args,))
    print(f"py_profile: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
