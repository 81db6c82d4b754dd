"""A rank's small matmuls before and after its first gloo all-gather, with
torch's thread setting and with sharc's ([Note: one thread for gloo's
threads] in sharc/compute_threads.py), side by side in one run.

    .venv/bin/python bench/compute_threads.py            # 1 rank, all cores
    .venv/bin/python bench/compute_threads.py --nproc 2

Each setting runs in fresh rank processes (a thread's OpenMP count is set
once, at its first parallel loop, so one process cannot show both). A rank
sets its threads to its share of the cores, times a matmul, all-gathers a
bucket as large as a small model's layer over gloo, and times the matmul
again; the threads gloo's workers started are counted from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from _common import markdown, write_results
from sharc import compute_threads
from sharc.launch import launch, threads_per_rank

SETTINGS = {"torch.set_num_threads": torch.set_num_threads,
            "sharc compute_threads.configure": compute_threads.configure}


def _matmul_us(size: int, repeats: int) -> float:
    a, b = torch.randn(size, size // 4), torch.randn(size // 4, size)
    for _ in range(repeats // 10):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - start) / repeats * 1e6


def _threads_named(name: str) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            count += f.read().strip() == name
    return count


def _rank_main(setting: str, args, out_dir: str) -> None:
    SETTINGS[setting](threads_per_rank(dist.get_world_size()))
    shard = torch.randn(args.gather_elements)
    out = torch.empty(shard.numel() * dist.get_world_size())
    before = _matmul_us(args.size, args.repeats)
    gloo_threads = _threads_named("pt_gloo_runloop")
    dist.all_gather_into_tensor(out, shard)
    dist.barrier()
    after = _matmul_us(args.size, args.repeats)
    row = {"setting": setting, "threads": torch.get_num_threads(),
           "matmul_us_before": round(before, 1), "matmul_us_after": round(after, 1),
           "after / before": round(after / before, 3),
           "threads_gloo_started": _threads_named("pt_gloo_runloop") - gloo_threads}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, setting), "w") as f:
            json.dump(row, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--size", type=int, default=256, help="the matmul's rows")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--gather-elements", type=int, default=1 << 18)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for setting in SETTINGS:
            launch(_rank_main, args.nproc, args=(setting, args, tmp))
            with open(os.path.join(tmp, setting)) as f:
                rows.append(json.load(f))
    after = {r["setting"]: r["matmul_us_after"] for r in rows}
    heading = (f"{args.nproc} rank(s), {rows[0]['threads']} threads each, rank 0: a "
               f"{args.size}x{args.size // 4} by {args.size // 4}x{args.size} matmul before "
               f"and after one gloo all-gather of {args.gather_elements} floats per rank; "
               f"after it, sharc's setting / torch's: "
               f"{after['sharc compute_threads.configure'] / after['torch.set_num_threads']:.3f}")
    table = markdown(rows, list(rows[0]))
    print(f"\n{heading}\n{table}")
    meta = {"nproc": args.nproc, "cpus": os.cpu_count(), "torch": torch.__version__}
    write_results(args.out, f"compute_threads_nproc{args.nproc}", meta, rows, heading, table)


if __name__ == "__main__":
    main()
