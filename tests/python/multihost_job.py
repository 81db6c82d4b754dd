"""A job for the multi-host tests, run under torchrun (across the rig's
simulated hosts or on one host): `multihost_job.py OUT [--steps N]
[--compile] [--hybrid] [--die-rank R --die-step S]`.

Trains the parity GPT sharded over the world for a few steps, each rank on
its slice of the global batch, and rank 0 writes to OUT (torch.save): the
losses (mean over ranks), the final full parameters, and for every rank its
node rank, local rank and network namespace (/proc/self/ns/net), so a test
can see where each rank really ran. With --hybrid the model is sharded on a
(2, world / 2) mesh ("replicate", "shard"): sharded within each host,
replicated across the two. With --die-rank, that rank kills itself
with SIGKILL at --die-step (a crash: no exception, no goodbye). With
--stall, every other rank writes OUT.stalled.RANK and sleeps instead of
training, so no collective tells it that a peer died: only the rig can stop
it (the dying rank then dies at once).
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import sharc
from models import global_batch, make_optimizer, make_parity_model, rank_slice
from sharc.launch import launch

BATCH = 8  # global sequences per step: 2 per rank at 4 ranks


def _where() -> dict:
    return {"rank": dist.get_rank(), "node_rank": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "netns": os.readlink("/proc/self/ns/net")}


def train(a) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if a.stall:  # shard() is collective: the dying rank dies before it
        if rank == a.die_rank:
            # Only once every other rank sleeps (its marker written): a rank
            # slow to start under load was otherwise stopped by the rig's
            # grace before it wrote its marker, and the test found none.
            others = [f"{a.out}.stalled.{r}" for r in range(world) if r != rank]
            deadline = time.monotonic() + 120
            while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        open(f"{a.out}.stalled.{rank}", "w").close()
        time.sleep(600)
    model = make_parity_model()
    if a.hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        sharc.shard(model, mesh=init_device_mesh("cpu", (2, world // 2),
                                                 mesh_dim_names=("replicate", "shard")))
    else:
        sharc.shard(model)
    opt = make_optimizer(model.parameters())
    step_fn = torch.compile(model, backend="sharc") if a.compile else model
    losses = []
    for step in range(a.steps):
        if rank == a.die_rank and step == a.die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = global_batch(step, BATCH)
        loss = step_fn(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = sharc.full_state_dict(model)
    where = [None] * world
    dist.all_gather_object(where, _where())
    if rank == 0:
        torch.save({"losses": losses, "params": params, "where": where}, a.out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-step", type=int, default=1)
    p.add_argument("--stall", action="store_true")
    a = p.parse_args()
    launch(train, 0, "gloo", (a,))  # under torchrun: this process is one rank


if __name__ == "__main__":
    main()
