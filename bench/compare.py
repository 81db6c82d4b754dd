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
import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

import sharc
from sharc.data import CharDataset
from sharc.launch import launch
from sharc.models.gpt import GPT, GPTConfig

COMPETITORS = ["sharc compiled", "sharc compiled, 4 MiB gather buckets", "sharc eager",
               "FSDP2 eager", "FSDP2 compiled", "DDP eager", "DDP compiled"]
MODEL = GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=256)


@dataclass
class Competitor:
    name: str
    model: torch.nn.Module
    step_fn: object
    opt: torch.optim.Optimizer
    error: str | None = None


def _fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


def _build(name: str) -> Competitor:
    model = _fresh_model()
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
    return Competitor(name, model, step_fn, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _train_step(c: Competitor, x, y) -> float:
    loss = c.step_fn(x, y)
    loss.backward()
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    return loss.item()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _resident_bytes(c: Competitor) -> int:
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


def _step_peak_bytes(c: Competitor, x, y) -> int:
    """Highest allocator level above the starting one during one step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        _train_step(c, x, y)
    # Every allocation and free the CPU allocator reported, in order.
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return peak


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
    competitors = []
    for name in names:
        c = _build(name)
        start = time.perf_counter()
        try:
            losses = [_train_step(c, *batch(s)) for s in range(args.warmup)]
        except Exception:  # noqa: BLE001  (a competitor that cannot run is reported)
            c.error = traceback.format_exc().strip().splitlines()[-1][:160]
            results[name] = {"error": c.error}
            continue
        results[name] = {"warmup_s": time.perf_counter() - start, "losses": losses}
        competitors.append(c)
    times = {c.name: [] for c in competitors}
    _time_rounds(competitors, times, batch, args)
    for c in competitors:
        results[c.name].update(
            step_s=statistics.median(times[c.name]),
            resident_bytes=_resident_bytes(c),
            step_peak_bytes=_step_peak_bytes(c, *batch(0)))
        if c.name.startswith("sharc"):
            group = sharc.api.sharded_root(c.model).group
            results[c.name]["peak_gathered_bytes"] = sharc.memory_stats(group)[
                "peak_gathered_bytes"]


def _time_rounds(competitors, times, batch, args) -> None:
    step = args.warmup
    for _ in range(args.rounds):
        for c in competitors:
            for _ in range(args.steps_per_round):
                x, y = batch(step)
                dist.barrier()
                t0 = time.perf_counter()
                _train_step(c, x, y)
                times[c.name].append(time.perf_counter() - t0)
            step += 1  # every competitor sees the same batches


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
    table = _markdown(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(f"Ratios are to sharc compiled (lower is better). {json.dumps(meta)}\n\n{table}\n")


def _markdown(rows: list[dict]) -> str:
    cols = ["competitor", "step_ms", "step_time_ratio", "peak_MiB_per_rank", "peak_ratio",
            "resident_MiB", "warmup_s", "first_loss"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['competitor']} | did not run: {r['error']} |" + " |" * (len(cols) - 2))
        else:
            lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


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
