"""Where one sharc compiled training step's time goes, measured and as
the timeline model predicted it.

    .venv/bin/python bench/breakdown.py                # every model, 2 gloo ranks
    .venv/bin/python bench/breakdown.py --size small   # one
    .venv/bin/python bench/breakdown.py --size switch --ops  # and per op

The model is compiled with backend="sharc" (default options) and trained
for a few warm-up steps, then `--steps` steps run under torch.profiler.
One step's time splits into:
  compute in graphs      the compiled graphs' time less sharc's ops in them
  gather waits           blocked in all-gather waits (the runtime's counter)
  reduction waits        blocked in reduce-scatter waits (the runtime's counter)
  bucket copies          copies and casts inside sharc's ops (into a
                         gather's input or a reduction's bucket, out of a
                         staging buffer or a reduced bucket)
  runtime and dispatch   the rest of sharc's ops: issuing collectives,
                         bookkeeping, the operators' dispatch
  optimizer              optimizer.step() and zero_grad()
  Python between graphs  the rest of the step: Dynamo's guards, eager code
                         at graph breaks, autograd's engine between graphs
Each figure is rank 0's mean per step in milliseconds; the slowest rank's
step is shown beside. The prediction is the timeline model's
(include/sharc/compiler/timeline.h) over each scheduled graph as dumped
by SHARC's dump_ir (rank 0), summed over the graphs, each assumed to run
once per step: compute (the measured node costs' sum) and exposed
communication (the time its waits hold the computation).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import torch
import torch.distributed as dist

import sharc
from _common import adamw, fresh_model, markdown, write_results
from compare import SIZES
from sharc.data import CharDataset
from sharc._compile.collective_costs import known_collective_costs
from sharc.launch import configure_threads, launch

_COPIES = ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::to", "aten::index_put_")


def _rank_main(args) -> None:
    configure_threads(dist.get_world_size())  # [Note: one thread for gloo's threads]
    for size in (list(SIZES) if args.size == "all" else [args.size]):
        _measure(size, args)


def _measure(size: str, args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SIZES[size]
    data = CharDataset()
    dump = tempfile.mkdtemp(prefix=f"sharc_breakdown_{size}_")
    model = fresh_model(config)
    group = dist.new_group()
    sharc.shard(model, group, config=sharc.ShardConfig(
        gather_units=getattr(model, "gather_units", ())))  # SwitchLM's experts
    step_fn = torch.compile(model, backend="sharc", options={"dump_ir": dump})
    opt = adamw(model)

    def step(i, profiled=False):
        x, y = data.rank_batch(i, args.batch, config.block_size, rank, world)
        with torch.profiler.record_function("bench::step"):
            loss = step_fn(x, y)
            loss.backward()
            with torch.profiler.record_function("bench::optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    sharc.reset_memory_stats(group)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            dist.barrier()
            step(args.warmup + i)
    stats = sharc.memory_stats(group)
    measured = _split(prof.events(), stats, args.steps)
    if args.ops and rank == 0:
        print(f"\n{size}: sharc's ops and what runs inside them (rank 0, per step)\n"
              f"{_ops_table(prof.events(), args.steps)}")
    predicted = _predict(dump, group.group_name) if rank == 0 else {}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, measured)
    if rank == 0:
        _report(size, config, per_rank, predicted, args)


def _split(events, stats: dict, steps: int) -> dict:
    """Rank-local milliseconds per step in each category (see the module
    docstring)."""
    def total(pred) -> float:
        return sum(e.cpu_time_total for e in events if pred(e)) / 1e3 / steps

    def outermost(e, prefix) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith(prefix):
                return False
            parent = parent.cpu_parent
        return True

    def inside(e, prefix) -> bool:
        return not outermost(e, prefix)

    is_graph = lambda e: e.name.startswith("## Call CompiledFxGraph")  # noqa: E731
    is_sharc = lambda e: e.name.startswith("sharc::") and outermost(e, "sharc::")  # noqa: E731
    step = total(lambda e: e.name == "bench::step")
    optimizer = total(lambda e: e.name == "bench::optimizer")
    graphs = total(is_graph)
    sharc_in_graphs = total(lambda e: is_sharc(e) and inside(e, "## Call CompiledFxGraph"))
    sharc_all = total(is_sharc)
    copies = total(lambda e: e.name in _COPIES and inside(e, "sharc::") and
                   outermost(e, tuple(_COPIES)))
    gather_wait = stats["gather_wait_ns"] / 1e6 / steps
    reduce_wait = stats["reduce_wait_ns"] / 1e6 / steps
    return {
        "step": step,
        "compute in graphs": graphs - sharc_in_graphs,
        "gather waits": gather_wait,
        "reduction waits": reduce_wait,
        "bucket copies": copies,
        "runtime and dispatch": sharc_all - gather_wait - reduce_wait - copies,
        "optimizer": optimizer,
        "Python between graphs": step - graphs - optimizer - (sharc_all - sharc_in_graphs),
        "graph calls": sum(1 for e in events if is_graph(e)) / steps,
    }


def _ops_table(events, steps: int, inside_rows: int = 20) -> str:
    """sharc's ops by total time, then the operators directly inside them:
    where "runtime and dispatch" and "bucket copies" go (a masked fill over
    every reduced bucket and one blocking collective per gather unit were
    found so)."""
    ops, inside = {}, {}
    for e in events:
        parent = e.cpu_parent
        nested = parent is not None and parent.name == e.name  # the op's own record inside
        if e.name.startswith("sharc::") and not nested:
            row = ops.setdefault(e.name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += e.cpu_time_total / 1e3 / steps
            row[2] += e.self_cpu_time_total / 1e3 / steps
        if parent is not None and parent.name.startswith("sharc::") and e.name != parent.name:
            row = inside.setdefault((parent.name, e.name), [0, 0.0])
            row[0] += 1
            row[1] += e.cpu_time_total / 1e3 / steps
    rows = [{"op": name, "inside": "", "calls_per_step": round(n / steps, 1),
             "total_ms": round(total, 2), "self_ms": round(own, 2)}
            for name, (n, total, own) in sorted(ops.items(), key=lambda kv: -kv[1][1])]
    rows += [{"op": parent, "inside": name, "calls_per_step": round(n / steps, 1),
              "total_ms": round(total, 2), "self_ms": ""}
             for (parent, name), (n, total) in
             sorted(inside.items(), key=lambda kv: -kv[1][1])[:inside_rows]]
    return markdown(rows, ["op", "inside", "calls_per_step", "total_ms", "self_ms"])


def _predict(dump: str, group_name: str) -> dict:
    """The timeline model over the scheduled graphs rank 0 dumped, with the
    collective costs the group agreed at its first compile (asking the
    runtime would measure again, a collective only rank 0 would join)."""
    costs = known_collective_costs(group_name) or []
    compute = exposed = 0.0
    files = sorted(glob.glob(os.path.join(dump, "rank0_*.after.ir")))
    for path in files:
        with open(path) as f:
            _, held, work = torch.classes.sharc.Scheduler.predict(f.read(), costs)
        compute += work
        exposed += held
    return {"compute in graphs": compute / 1e3, "exposed communication": exposed / 1e3,
            "graphs": len(files)}


def _report(size: str, config, per_rank: list[dict], predicted: dict, args) -> None:
    ours = per_rank[0]
    rows = []
    for key in ("compute in graphs", "gather waits", "reduction waits", "bucket copies",
                "runtime and dispatch", "optimizer", "Python between graphs", "step"):
        share = ours[key] / ours["step"] if ours["step"] else 0.0
        row = {"term": key, "measured_ms": round(ours[key], 2), "share": round(share, 3),
               "slowest_rank_ms": round(max(r[key] for r in per_rank), 2)}
        row["predicted_ms"] = {
            "compute in graphs": round(predicted["compute in graphs"], 2),
            "gather waits": round(predicted["exposed communication"], 2),
        }.get(key, "")
        rows.append(row)
    meta = {"size": size, "model": repr(config), "world_size": len(per_rank),
            "batch_per_rank": args.batch, "profiled_steps": args.steps,
            "graph_calls_per_step": ours["graph calls"], "graphs_dumped": predicted["graphs"],
            "torch": torch.__version__, "device": "cpu", "backend": "gloo"}
    note = ("predicted_ms: the timeline model's compute (sum of measured node costs) and "
            "exposed communication (all waits, shown on the gather row), over rank 0's graphs.")
    table = markdown(rows, ["term", "measured_ms", "share", "slowest_rank_ms", "predicted_ms"])
    print(f"\n{size}: one sharc compiled step (rank 0, mean of {args.steps})\n{table}\n{note}")
    write_results(args.out, f"breakdown_{size}", meta, rows,
                  f"Where one sharc compiled step's time goes. {note}", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--ops", action="store_true",
                        help="also print sharc's ops and the operators inside them")
    args = parser.parse_args()
    start = time.perf_counter()
    launch(_rank_main, args.nproc, args=(args,))
    print(f"breakdown: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
