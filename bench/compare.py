"""sharc compiled vs sharc eager vs FSDP2 vs DDP: step time and peak memory
per rank, in one run, on the same model, data and ranks.

    .venv/bin/python bench/compare.py            # 2 gloo ranks, CPU

Every competitor trains its own copy of the same GPT (same initial weights,
same batches) with AdamW. Step time is the median over interleaved rounds
(each round times a few steps of every competitor in turn, so machine noise
hits all of them alike), after warm-up steps that include compilation.

Peak memory per rank is exact byte accounting, in two parts:
  resident: bytes of the parameters, gradients and optimizer state this rank
            holds between steps (tensor storages, each counted once);
  step:     the highest level the CPU allocator reached above that during one
            training step (torch.profiler's memory events, summed in order).
DDP's internal gradient buckets are allocated at construction and not seen
by either part, so DDP's figure is a lower bound.

Prints a table of ratios to sharc compiled and writes it as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import sharc
from _common import (MODEL, Competitor, adamw, fresh_model, markdown, median_step_s,
                     profiled_step, resident_bytes, step_peak_bytes, time_rounds, warm_up,
                     write_results)
from sharc.data import CharDataset
from sharc.launch import launch

COMPETITORS = ["sharc compiled", "sharc compiled, 4 MiB gather buckets", "sharc eager",
               "FSDP2 eager", "FSDP2 compiled", "DDP eager", "DDP compiled"]


def _build(name: str) -> Competitor:
    model = fresh_model()
    if name.startswith("sharc"):
        sharc.shard(model, dist.new_group())  # a runtime (and counters) of its own
        step_fn = model
        if name == "sharc compiled":
            step_fn = torch.compile(model, backend="sharc")
        elif name.startswith("sharc compiled, 4 MiB"):  # trades gathered bytes for fewer calls
            step_fn = torch.compile(model, backend="sharc",
                                    options={"gather_bucket_bytes": 4 << 20})
    elif name.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step_fn = torch.compile(model) if name == "FSDP2 compiled" else model
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        step_fn = torch.compile(model) if name == "DDP compiled" else model
    return Competitor(name, model, step_fn, adamw(model))


def _rank_main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = CharDataset()

    def batch(step):
        return data.rank_batch(step, args.batch, MODEL.block_size, rank, world)

    names = [n for n in COMPETITORS
             if not args.only or n in args.only or n == "sharc compiled"]
    results = {}
    # FSDP2 compiled is built, timed and measured last, alone: once Dynamo has
    # compiled FSDP2's graph-breaking GPT.forward, another compiled model of
    # that class in the same process no longer compiles cleanly (see the
    # limitations in docs/design/compiled-schedule.md).
    for phase in ([n for n in names if n != "FSDP2 compiled"],
                  [n for n in names if n == "FSDP2 compiled"]):
        _run_phase(phase, results, batch, args)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, results)
    if rank == 0:
        _report(per_rank, args)


def _run_phase(names, results, batch, args) -> None:
    competitors = warm_up(names, _build, batch, args.warmup, results)
    times = time_rounds(competitors, batch, args)
    for c in competitors:
        results[c.name].update(
            step_s=median_step_s(times[c.name]),
            resident_bytes=resident_bytes(c),
            step_peak_bytes=step_peak_bytes(profiled_step(c, *batch(0))))
        if c.name.startswith("sharc"):
            group = sharc.api.sharded_root(c.model).group
            results[c.name]["peak_gathered_bytes"] = sharc.memory_stats(group)[
                "peak_gathered_bytes"]


def _report(per_rank: list[dict], args) -> None:
    names = list(per_rank[0])
    base = per_rank[0]["sharc compiled"]
    rows = []
    for name in names:
        r0 = per_rank[0][name]
        if "error" in r0:
            rows.append({"competitor": name, "error": r0["error"]})
            continue
        step_s = max(r[name]["step_s"] for r in per_rank)
        peak = max(r[name]["resident_bytes"] + r[name]["step_peak_bytes"] for r in per_rank)
        rows.append({
            "competitor": name,
            "step_ms": round(step_s * 1e3, 1),
            "step_time_ratio": round(step_s / max(r["sharc compiled"]["step_s"]
                                                  for r in per_rank), 3),
            "peak_MiB_per_rank": round(peak / 2**20, 2),
            "peak_ratio": round(peak / max(r["sharc compiled"]["resident_bytes"] +
                                           r["sharc compiled"]["step_peak_bytes"]
                                           for r in per_rank), 3),
            "resident_MiB": round(max(r[name]["resident_bytes"] for r in per_rank) / 2**20, 2),
            "warmup_s": round(r0["warmup_s"], 1),
            "first_loss": round(r0["losses"][0], 4),
        })
    meta = {"world_size": len(per_rank), "backend": "gloo", "device": "cpu",
            "torch": torch.__version__, "model": repr(MODEL),
            "batch_per_rank": args.batch, "timed_steps": args.rounds * args.steps_per_round,
            "sharc_compiled_peak_gathered_bytes": base.get("peak_gathered_bytes"),
            "sharc_eager_peak_gathered_bytes": per_rank[0].get("sharc eager", {}).get(
                "peak_gathered_bytes")}
    table = markdown(rows, ["competitor", "step_ms", "step_time_ratio", "peak_MiB_per_rank",
                            "peak_ratio", "resident_MiB", "warmup_s", "first_loss"])
    print(table)
    write_results(args.out, "compare", meta, rows,
                  "Ratios are to sharc compiled (lower is better).", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=COMPETITORS,
                        help="run only these competitors (sharc compiled always runs)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    launch(_rank_main, args.nproc, args=(args,))


if __name__ == "__main__":
    main()
