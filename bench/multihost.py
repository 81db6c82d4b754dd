"""Flat ZeRO-3 against hybrid sharding across two simulated hosts, beside
FSDP2 (flat and HSDP) and DDP, on the rig (sharc.multihost).

    PYTHONPATH=python python bench/multihost.py [--rate 200mbit]

2 hosts x 2 ranks, gloo, fp32, eager; model bench/_common.MODEL (GPT, 4
layers, 256 wide), 4 sequences of 128 tokens per rank, AdamW. Each row: the
median step time of --steps timed steps after --warmup (rank 0's clock,
every step starting at a barrier), and the bytes host 0 sent / received
over its link per step (counted on the veth, set-up included), all in one
run. Then the ratios, and the cost model's prediction of the flat / hybrid
step-time ratio (sharc/core/collective_cost.h, through
torch.classes.sharc.Scheduler): each step = the same step with the link
unlimited (measured, sharc flat) + the bytes the model says a host sends
over its link per step, at the link rate; and the same with the bytes
measured on the link instead. Needs root; exits 77 where the rig cannot be
built.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH, SEQ = 4, 128
HOSTS, PER_HOST = 2, 2
MODES = ["sharc flat", "sharc hybrid", "FSDP2 flat", "FSDP2 HSDP", "DDP"]


def _wrap(model, mode: str):
    """The model ready to train under `mode`; its parameters for the optimizer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import sharc

    world = dist.get_world_size()
    if mode == "sharc flat":
        return sharc.shard(model)
    if mode == "sharc hybrid":
        mesh = init_device_mesh("cpu", (world // PER_HOST, PER_HOST),
                                mesh_dim_names=("replicate", "shard"))
        return sharc.shard(model, mesh=mesh)
    if mode == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    if mode == "FSDP2 flat":
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // PER_HOST, PER_HOST),
                                mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def job(out: str, mode: str, warmup: int, steps: int) -> None:
    """A rank (under torchrun): time each step; rank 0 writes JSON to out."""
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
    result = {"mode": mode}
    try:
        model = _wrap(GPT(MODEL), mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = CharDataset()
        times = []
        for step in range(warmup + steps):
            x, y = data.rank_batch(step, BATCH, SEQ, rank, world, seed=0, split="train")
            if step == warmup and mode.startswith("sharc"):
                sharc.reset_memory_stats(sharc.api.sharded_root(model).group)
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                                     y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        result["step_s"] = statistics.median(times[warmup:])
        result["param_bytes"] = sum(p.numel() * p.element_size()
                                    for p in GPT(MODEL).parameters())
        if mode.startswith("sharc"):
            stats = sharc.memory_stats(sharc.api.sharded_root(model).group)
            for key in ("allgather_bytes", "reduce_scatter_bytes", "all_reduce_bytes"):
                result[key + "_per_step"] = stats[key] / steps
    except Exception as e:  # a framework that cannot run here: say why, in its row
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _run(target: list[str], mode: str, rate: str | None, out: str, prefix: str) -> dict:
    from sharc.multihost import JobConfig, Rig, RigConfig, run_job

    with Rig(RigConfig(hosts=HOSTS, rate=rate, prefix=prefix)) as rig:
        code = run_job(rig, JobConfig(nproc_per_host=PER_HOST), [*target, "--mode", mode,
                                                                 "--job", out])
        links = rig.link_bytes()
    result = {"mode": mode, "error": f"job exit code {code}"}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    result["links"] = links
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=MODES)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job is not None:
        job(a.job, a.mode, a.warmup, a.steps)
        return 0
    from sharc.multihost import preflight, rate_bits

    reason = preflight()
    if reason:
        print(f"multihost: {reason}", file=sys.stderr)
        return 77
    target = [os.path.abspath(__file__), "--warmup", str(a.warmup), "--steps", str(a.steps)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    total = a.warmup + a.steps
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = _run(target, "sharc flat", None, os.path.join(tmp, "base.json"), "sharcmhb")
        for i, mode in enumerate(a.modes):
            rows[mode] = _run(target, mode, a.rate, os.path.join(tmp, f"{i}.json"), "sharcmhb")
    bits = rate_bits(a.rate)
    print(f"2 hosts x 2 ranks, link {a.rate}; {a.steps} timed steps after {a.warmup}")
    print("| row | step (median) | host 0 link MB/step sent / received | sharc MB/step "
          "per rank: all-gather / reduce-scatter (shard group) / all-reduce (replicate) |")
    print("| --- | --- | --- | --- |")
    link = {}
    for mode in ["sharc flat, link unlimited", *a.modes]:
        r = base if mode.endswith("unlimited") else rows[mode]
        sent = r["links"][0]["tx_bytes"] / total
        got = r["links"][0]["rx_bytes"] / total
        link[mode] = max(sent, got)
        step = f"{r['step_s'] * 1e3:.0f} ms" if "step_s" in r else f"failed: {r['error']}"
        ours = "-"
        if "allgather_bytes_per_step" in r:
            ours = (f"{r['allgather_bytes_per_step'] / 1e6:.2f} / "
                    f"{r['reduce_scatter_bytes_per_step'] / 1e6:.2f} / "
                    f"{r['all_reduce_bytes_per_step'] / 1e6:.2f}")
        print(f"| {mode} | {step} | {sent / 1e6:.1f} / {got / 1e6:.1f} | {ours} |")
    flat, hyb = rows.get("sharc flat", {}), rows.get("sharc hybrid", {})
    if "step_s" in flat and "step_s" in hyb and "step_s" in base:
        import torch

        import sharc  # noqa: F401  (loads torch.classes.sharc)

        model = torch.classes.sharc.Scheduler
        measured = flat["step_s"] / hyb["step_s"]
        t0 = base["step_s"] * 1e6
        predicted = ((t0 + link["sharc flat"] * 8 / bits * 1e6)
                     / (t0 + link["sharc hybrid"] * 8 / bits * 1e6))
        p_bytes = flat["param_bytes"]
        b_flat = model.inter_host_bytes(p_bytes, HOSTS, PER_HOST, False)
        b_hyb = model.inter_host_bytes(p_bytes, HOSTS, PER_HOST, True)
        modelled = (model.predict_step_us(t0, b_flat, bits)
                    / model.predict_step_us(t0, b_hyb, bits))
        print(f"hybrid / flat bytes over the slow link: "
              f"{link['sharc hybrid'] / link['sharc flat']:.2f} measured, "
              f"{b_hyb / b_flat:.2f} by the cost model ({b_flat / 1e6:.1f} and "
              f"{b_hyb / 1e6:.1f} MB per host and step)")
        print(f"flat / hybrid step time: measured {measured:.2f}; cost model {modelled:.2f} "
              f"({abs(modelled - measured) / measured * 100:.0f}% apart); from the measured "
              f"link bytes {predicted:.2f} ({abs(predicted - measured) / measured * 100:.0f}% "
              "apart)")
        hsdp = rows.get("FSDP2 HSDP", {})
        if "step_s" in hsdp:
            print(f"sharc hybrid / FSDP2 HSDP step time: {hyb['step_s'] / hsdp['step_s']:.2f}")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
