"""The main job: train a small GPT on Tiny Shakespeare, sharded over N ranks.

    python -m sharc.train                      # 2 local gloo ranks
    torchrun --nproc-per-node 2 -m sharc.train # the same under torchrun
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import sharc
from sharc.data import CharDataset
from sharc.launch import configure_threads, launch
from sharc.models.gpt import GPT, GPTConfig


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 120
    batch_per_rank: int = 8
    seq_len: int = 128
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    lr: float = 1e-3
    seed: int = 0
    log_every: int = 10
    compile: bool = False
    """Compile the model with torch.compile(backend="sharc")."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_per_rank", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def _parse(argv=None) -> tuple[TrainConfig, int]:
    p = argparse.ArgumentParser(prog="sharc-train", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun)")
    defaults = TrainConfig()
    for field in TrainConfig.__dataclass_fields__:
        value = getattr(defaults, field)
        if isinstance(value, bool):
            p.add_argument(f"--{field.replace('_', '-')}", default=value,
                           action=argparse.BooleanOptionalAction)
        else:
            p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    a = vars(p.parse_args(argv))
    nproc = a.pop("nproc")
    return TrainConfig(**a), nproc


def _progress(rank: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="sharc train", unit="step", dynamic_ncols=True)


def _rank_memory_mib(group_size: int) -> str:
    stats = sharc.memory_stats()
    mine = (stats["shard_bytes"], stats["peak_gathered_bytes"])
    everyone = [None] * group_size
    dist.all_gather_object(everyone, mine)
    return " ".join(f"r{r}:{s / 2**20:.1f}+{g / 2**20:.1f}MiB" for r, (s, g) in enumerate(everyone))


def train(cfg: TrainConfig) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    data = CharDataset()
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=cfg.seq_len,
                          n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))
    n_params = sum(p.numel() for p in model.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sharc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    step_fn = torch.compile(model, backend="sharc") if cfg.compile else model
    if rank == 0:
        print(f"sharc: {n_params / 1e6:.2f}M parameters, {world} ranks "
              f"({dist.get_backend()}), {cfg.batch_per_rank}x{cfg.seq_len} tokens per rank; "
              f"unsharded parameters {full_bytes / 2**20:.1f} MiB, this rank's shards "
              f"{sharc.memory_stats()['shard_bytes'] / 2**20:.1f} MiB", flush=True)
    bar = _progress(rank, cfg.steps)
    first = last = None
    tokens_per_step = cfg.batch_per_rank * cfg.seq_len * world
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = data.rank_batch(step, cfg.batch_per_rank, cfg.seq_len, rank, world, cfg.seed)
        loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        last = mean_loss.item() / world
        first = last if first is None else first
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            memory = _rank_memory_mib(world)  # collective: every rank takes part
            if bar is not None:
                rate = tokens_per_step * (step + 1) / (time.perf_counter() - t0)
                bar.set_postfix_str(f"loss {last:.3f} | {rate:,.0f} tok/s | mem {memory}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
        elapsed = time.perf_counter() - t0
        print(f"sharc: loss {first:.4f} -> {last:.4f} in {cfg.steps} steps, {elapsed:.1f}s "
              f"({tokens_per_step * cfg.steps / elapsed:,.0f} tok/s)", flush=True)
        print(f"sharc: rank 0 memory {sharc.memory_stats()}", flush=True)


def main(argv=None) -> None:
    cfg, nproc = _parse(argv)
    launch(train, nproc, "gloo", (cfg,))


if __name__ == "__main__":
    main()
