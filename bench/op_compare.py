"""The same training step's operators, side by side: the floor, DDP
compiled and sharc compiled, in one run, on the same ranks and batches.

    .venv/bin/python bench/op_compare.py                  # the small GPT, 2 gloo ranks
    .venv/bin/python bench/op_compare.py --size switch

breakdown.py splits sharc's step into terms; this script asks a different
question: which operators take longer in sharc's step than in the same
model's step without sharc. Each competitor (built as compare.py builds
it) trains `--warmup` steps, then `--steps` unprofiled steps are timed,
then `--steps` more run under torch.profiler; rank 0's self time per step
is summed by group:

  matmuls             aten::mm, addmm, bmm (Inductor's extern kernels)
  Inductor kernels    the generated C++ kernels, each recorded on its own
                      (Inductor's cpp.enable_kernel_profile)
  graph wrappers      the compiled graphs' Python wrappers, less every
                      operator they call: argument checks, op calls' cost
  copies              aten::copy_, cat, split_with_sizes_copy, _foreach_copy_
  sharc's ops         sharc::* (blocked waits included)
  collectives         c10d::* (issue; gloo's transfers run on its threads)
  optimizer           optimizer.step() and zero_grad(), every operator
                      inside them
  the rest            every other operator and Python-level region

Competitors are built and measured in the order given; name "FSDP2
compiled" last, if at all (compare.py measures it last, alone: once Dynamo
compiled FSDP2's graph-breaking forward, another compiled model of that
class in the process no longer compiles cleanly).

The profiler adds a few microseconds to every operator, so a group of many
small calls reads higher than it costs unprofiled; the unprofiled step is
printed beside. Also printed: minor page faults per unprofiled step
(resource.getrusage), since a freed and re-allocated large buffer costs
faults in whichever operator first writes it.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import time

import torch
import torch.distributed as dist

from _common import markdown, train_step, write_results
from compare import COMPETITORS, SIZES, _build
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch

GROUPS = ("matmuls", "Inductor kernels", "graph wrappers", "copies", "sharc's ops",
          "collectives", "optimizer", "the rest")
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm"}
_COPIES = {"aten::copy_", "aten::cat", "aten::split_with_sizes_copy", "aten::_foreach_copy_"}


def _in_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer."):
            return True
        event = event.cpu_parent
    return False


def _group(event) -> str:
    key = event.name
    if _in_optimizer(event):
        return "optimizer"
    if key in _MATMULS:
        return "matmuls"
    if "cpp_fused" in key:
        return "Inductor kernels"
    if key.startswith("## Call CompiledFxGraph"):
        return "graph wrappers"
    if key in _COPIES:
        return "copies"
    if key.startswith("sharc::"):
        return "sharc's ops"
    if key.startswith("c10d::") or key.startswith("gloo:"):
        return "collectives"
    return "the rest"


def _measure(name: str, config, batch, args) -> dict:
    c = _build(name, config)
    for step in range(args.warmup):
        train_step(c, *batch(step))
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for step in range(args.steps):
        train_step(c, *batch(args.warmup + step))
    step_ms = (time.perf_counter() - start) * 1e3 / args.steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(args.steps):
            train_step(c, *batch(args.warmup + args.steps + step))
    groups, rest = collections.Counter(), collections.Counter()
    for event in prof.events():
        group = _group(event)
        groups[group] += event.self_cpu_time_total / 1e3 / args.steps
        if group == "the rest":
            rest[event.name] += event.self_cpu_time_total / 1e3 / args.steps
    dist.barrier()
    return {"step_ms": step_ms, "faults": faults, **groups, "rest": rest}


def _rank_main(args) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel its own event
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
    names = list(measured)
    rows = []
    for key in ("step_ms", *GROUPS, "faults"):
        label = {"step_ms": "step, unprofiled", "faults": "minor page faults"}.get(key, key)
        row = {"ms per step": label}
        for name in names:
            row[name] = round(measured[name].get(key, 0.0), 2)
        for other in names[:-1]:  # the last competitor against each of the others
            row[f"{names[-1]} - {other}"] = round(row[names[-1]] - row[other], 2)
        rows.append(row)
    cols = list(rows[0])
    table = markdown(rows, cols)
    meta = {"size": args.size, "model": repr(config), "world_size": dist.get_world_size(),
            "batch_per_rank": args.batch, "steps": args.steps, "torch": torch.__version__,
            "device": "cpu", "backend": "gloo"}
    heading = ("Operators' self time per step, rank 0, under torch.profiler (profiled steps; "
               "the first row unprofiled).")
    print(f"\n{args.size}: {heading}\n{table}")
    for name in names if args.detail else ():
        print(f"\n{name}: the rest's largest entries, ms per step")
        for key, ms in measured[name]["rest"].most_common(args.detail):
            print(f"  {ms:8.2f}  {key}")
    write_results(args.out, f"op_compare_{args.size}", meta, rows, heading, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--competitors", nargs="+",
                        default=["floor", "DDP compiled", "sharc compiled"],
                        choices=COMPETITORS, metavar="NAME",
                        help="compare.py's competitor names; the last is set against each "
                             "of the others")
    parser.add_argument("--detail", type=int, default=0,
                        help="also print this many of the rest's largest entries per competitor")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    start = time.perf_counter()
    launch(_rank_main, args.nproc, args=(args,))
    print(f"op_compare: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
