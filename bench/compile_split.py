"""How much of sharc compiled's first step (compilation included) is
sharc's own work: its FX pipeline (_compile/fx_pipeline.py: the graph
checks and rewrites, and the scheduler's per-graph work: lowering, the C++
passes, rebuilding the graph), within it the compute profiling, and the
rest (Dynamo, AOTAutograd, Inductor, the step itself).

    .venv/bin/python bench/compile_split.py --size small

Each of sharc's functions is wrapped with a timer in every rank before the
model compiles; rank 0's seconds are printed and written to
bench/results/compile_split_<size>.{json,md}. Inductor's on-disk cache is
whatever TORCHINDUCTOR_CACHE_DIR holds: a cold cache charges Inductor's
C++ kernel builds to this step.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist

import sharc
import sharc._compile.fx_pipeline as fx_pipeline
import sharc._compile.schedule as schedule
from _common import Competitor, adamw, fresh_model, markdown, train_step, write_results
from compare import SIZES
from sharc.data import CharDataset
from sharc.launch import launch

_SECONDS: dict[str, float] = {}


def _timed(module, name: str, label: str) -> None:
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _SECONDS[label] = _SECONDS.get(label, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)


def _rank_main(args) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    _timed(fx_pipeline, "run", "sharc's FX pipeline (all of it)")
    _timed(schedule, "profile_compute", "of which compute profiling")
    config = SIZES[args.size]
    model = fresh_model(config)
    sharc.shard(model, dist.new_group(), config=sharc.ShardConfig(
        gather_units=getattr(model, "gather_units", ())))
    c = Competitor("sharc compiled", model, torch.compile(model, backend="sharc"), adamw(model))
    x, y = CharDataset().rank_batch(0, args.batch, config.block_size, dist.get_rank(),
                                    dist.get_world_size())
    start = time.perf_counter()
    train_step(c, x, y)
    first = time.perf_counter() - start
    if dist.get_rank() == 0:
        own = _SECONDS.get("sharc's FX pipeline (all of it)", 0.0)
        rows = [{"part": "first step", "seconds": round(first, 2)},
                *({"part": k, "seconds": round(v, 2)} for k, v in _SECONDS.items()),
                {"part": "the rest (Dynamo, AOTAutograd, Inductor, the step)",
                 "seconds": round(first - own, 2)}]
        table = markdown(rows, ["part", "seconds"])
        print(f"\n{args.size}\n{table}")
        write_results(args.out, f"compile_split_{args.size}",
                      {"size": args.size, "model": repr(config), "world_size": 2,
                       "torch": torch.__version__, "device": "cpu", "backend": "gloo",
                       "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")},
                      rows, "sharc compiled's first step, rank 0.", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    launch(_rank_main, 2, args=(parser.parse_args(),))


if __name__ == "__main__":
    main()
