"""One sharc training step (eager, fp32, flat ZeRO-3) with the ranks on one
host vs on two simulated hosts (sharc.multihost) at each link rate.

    PYTHONPATH=python python bench/multihost_step.py [--rates none 200mbit]

Model: bench/_common.MODEL (GPT, 4 layers, 256 wide), 8 sequences of 128
tokens per rank, AdamW; one rank per host (2 ranks in all) so that the two
ranks never share a core. Each row: the median of --steps timed steps
after --warmup, rank 0's clock, and the bytes host 0 sent and received over
its link per step (counted on the veth, not by sharc). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH, SEQ = 8, 128


def job(out: str, warmup: int, steps: int) -> None:
    """A rank (under torchrun): time each step, rank 0 writes JSON to out."""
    import torch
    import torch.distributed as dist

    import sharc
    from _common import MODEL
    from sharc.data import CharDataset
    from sharc.models.gpt import GPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(MODEL)
    sharc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CharDataset()
    times = []
    for step in range(warmup + steps):
        x, y = data.rank_batch(step, BATCH, SEQ, rank, world, seed=0, split="train")
        if step == warmup:
            sharc.reset_memory_stats()
        dist.barrier()  # every step starts together: the time is the slowest rank's
        t0 = time.perf_counter()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    stats = sharc.memory_stats()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times[warmup:]),
                       "allgather_bytes_per_step": stats["allgather_bytes"] / steps,
                       "reduce_scatter_bytes_per_step": stats["reduce_scatter_bytes"] / steps,
                       "params": sum(p.numel() for p in GPT(MODEL).parameters())}, f)
    dist.destroy_process_group()


def _run(target: list[str], rate: str | None, two_hosts: bool, out: str) -> dict:
    """One job; its JSON, with host 0's link bytes over the whole job."""
    from sharc.multihost import JobConfig, Rig, RigConfig, run_job

    if not two_hosts:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", *target, "--job", out], check=True)
        links = None
    else:
        with Rig(RigConfig(hosts=2, rate=rate, prefix="sharcmhstep")) as rig:
            if run_job(rig, JobConfig(nproc_per_host=1), [*target, "--job", out]) != 0:
                raise RuntimeError(f"the job failed with the link at {rate}")
            links = rig.link_bytes()
    with open(out) as f:
        result = json.load(f)
    result["links"] = links
    return result


def _row(label: str, runs: list[dict], total_steps: int, rate: str | None) -> str:
    steps = ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in runs)
    median = statistics.median(r["step_s"] for r in runs)
    link = wire = "-"
    if runs[0]["links"]:
        sent = statistics.median(r["links"][0]["tx_bytes"] for r in runs) / total_steps
        got = statistics.median(r["links"][0]["rx_bytes"] for r in runs) / total_steps
        link = f"{sent / 1e6:.1f} / {got / 1e6:.1f}"
        if rate:
            from sharc.multihost import rate_bits

            wire = f"{max(sent, got) * 8 / rate_bits(rate) * 1e3:.0f} ms"
    r = runs[0]
    return (f"| {label} | {median * 1e3:.0f} ms ({steps}) | {link} | {wire} | "
            f"{r['allgather_bytes_per_step'] / 1e6:.1f} / "
            f"{r['reduce_scatter_bytes_per_step'] / 1e6:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", nargs="+", default=["none", "200mbit"],
                   help="link rates of the two-host rows ('none': unlimited)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2,
                   help="each configuration runs once per round, in turn (noise hits all)")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job is not None:
        job(a.job, a.warmup, a.steps)
        return 0
    from sharc.multihost import preflight

    reason = preflight()
    if reason:
        print(f"multihost_step: {reason}", file=sys.stderr)
        return 77
    target = [os.path.abspath(__file__), "--warmup", str(a.warmup), "--steps", str(a.steps)]
    # The ranks import _common from bench/.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    configs = [("2 on one host (loopback)", None, False)] + [
        (f"2 hosts x 1, link {r if r != 'none' else 'unlimited'}", None if r == "none" else r,
         True) for r in a.rates]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.rounds):
            for label, rate, two_hosts in configs:
                out = os.path.join(tmp, f"{k}-{len(runs[label])}-{rate}-{two_hosts}.json")
                runs[label].append(_run(target, rate, two_hosts, out))
    load.append(os.getloadavg()[0])
    print(f"| ranks | step, median of rounds (each round's median of {a.steps} steps) | host 0's "
          "link per step, MB sent / received (set-up included) | that at the link rate | "
          "sharc all-gather / reduce-scatter MB per step |")
    print("| --- | --- | --- | --- | --- |")
    for label, rate, _ in configs:
        print(_row(label, runs[label], a.warmup + a.steps, rate))
    print(f"load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f} "
          f"on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
