"""What making released memory unreadable costs: the runtime's release, per
call and per training step, on 2 gloo ranks (CPU).

    .venv/bin/python bench/release_cost.py

A release frees a gathered buffer's bytes in place and leaves c10's
data-pointer access error on the storage (naming the parameter), so a
reference kept past the release raises on any read instead of reading freed
memory; the eager release also checks whether a tensor it handed out is
still alive (and hands the buffer over to it). Nothing of this runs on any
operator's path: c10 tests the storage's flag on data access whether it is
set or not. The cost is the release call itself, measured here:

- per call, for each parameter of the benchmark's GPT (4 layers, 256 wide):
  the compiled path's `release(id, "free")` and the eager path's
  `release(id, "free_or_hand_over")`,
  each timed alone after a gather, against a call of the same binding that
  does nothing (`state`), which is what Python's call into the runtime costs;
- per step: the releases one eager training step makes (its `sharc::release`
  profiler events) times the measured cost, as a share of the step.

Writes bench/results/release_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import sharc
from _common import MODEL, adamw, fresh_model, markdown, write_results
from sharc.api import sharded_root
from sharc.data import CharDataset
from sharc.launch import launch


def _per_call_us(runtime, pids: list[int], call: str, rounds: int) -> float:
    """Median µs of one release in mode `call` on a gathered parameter (or
    of `state`)."""
    times = []
    for _ in range(rounds):
        for pid in pids:
            if call == "state":
                t0 = time.perf_counter()
                runtime.state(pid)
                times.append(time.perf_counter() - t0)
                continue
            full = runtime.gather(pid)  # collective: every rank runs the same loop
            del full
            t0 = time.perf_counter()
            runtime.release(pid, call)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _step(model, opt, data, step, rank, world):
    x, y = data.rank_batch(step, 4, MODEL.block_size, rank, world)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _rank_main(args) -> None:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fresh_model()
    sharc.shard(model)
    root = sharded_root(model)
    pids = sorted({ref.pid for ref in root.refs_by_shard.values()})
    costs = {call: _per_call_us(root.runtime, pids, call, args.rounds)
             for call in ("state", "free", "free_or_hand_over")}
    opt, data = adamw(model), CharDataset()
    for s in range(3):
        _step(model, opt, data, s, rank, world)
    step_s = []
    for s in range(3, 3 + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, data, s, rank, world)
        step_s.append(time.perf_counter() - t0)
    with torch.profiler.profile() as prof:
        _step(model, opt, data, 99, rank, world)
    releases = sum(1 for e in prof.events() if e.name == "sharc::release")
    result = {"costs": costs, "step_ms": statistics.median(step_s) * 1e3, "releases": releases,
              "params": len(pids)}
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        _report(everyone, args)


def _report(everyone: list[dict], args) -> None:
    base = max(r["costs"]["state"] for r in everyone)
    step_ms = max(r["step_ms"] for r in everyone)
    releases = everyone[0]["releases"]
    rows = []
    for call, path in (("free", "compiled (release, \"free\")"),
                       ("free_or_hand_over", "eager (release, \"free_or_hand_over\")")):
        us = max(r["costs"][call] for r in everyone)
        rows.append({"path": path, "us_per_release": round(us, 2),
                     "us_above_binding_call": round(us - base, 2),
                     "releases_per_eager_step": releases,
                     "ms_per_step": round(releases * us / 1e3, 3),
                     "share_of_eager_step": f"{releases * us / 1e3 / step_ms:.2%}"})
    meta = {"world_size": len(everyone), "backend": "gloo", "device": "cpu",
            "torch": torch.__version__, "parameters_timed": everyone[0]["params"],
            "binding_call_us": round(base, 2), "eager_step_ms": round(step_ms, 1)}
    table = markdown(rows, list(rows[0]))
    print(f"\n{table}\n{meta}")
    write_results(args.out, "release_cost", meta, rows,
                  "What a release costs (times the slowest rank's median).", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    launch(_rank_main, 2, args=(args,))


if __name__ == "__main__":
    main()
