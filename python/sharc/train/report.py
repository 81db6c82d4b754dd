"""The trainer's memory figures: per rank, gathered from every rank, and the
lines it prints at the start and the end."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

import sharc

MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB / 10 else f"{n / 1024:.1f} KiB"


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def rank_memory(opt: torch.optim.Optimizer) -> dict:
    """This rank's figures: sharc's exact bytes (peak since the last reset),
    its optimizer state, and the process's peak resident set."""
    stats = sharc.memory_stats()
    return {"rank": dist.get_rank(),
            "shard_bytes": stats["shard_bytes"],
            "optimizer_state_bytes": optimizer_state_bytes(opt),
            "peak_gathered_bytes": stats["peak_gathered_bytes"],
            "allgather_bytes": stats["allgather_bytes"],
            "reduce_scatter_bytes": stats["reduce_scatter_bytes"],
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def all_rank_memory(opt: torch.optim.Optimizer) -> list[dict]:
    """Every rank's figures, on every rank. Collective."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rank_memory(opt))
    return everyone


def savings_line(model: torch.nn.Module, world: int) -> str:
    """What sharding saves per rank, for parameters plus AdamW's two state
    tensors per trainable parameter (measured before shard())."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    full = params + 2 * trainable
    per_rank = sum(_padded(p, world) * p.element_size() * (3 if p.requires_grad else 1)
                   for p in model.parameters())
    return (f"sharc: memory per rank for parameters + AdamW state: unsharded {_mib(full)}, "
            f"sharded over {world} ranks {_mib(per_rank)} (saves {_mib(full - per_rank)}, "
            f"{100 * (1 - per_rank / full):.0f}%); full parameters exist only while gathered")


def _padded(p: torch.Tensor, world: int) -> int:
    return -(-p.numel() // world)  # this rank's shard: ceil(n / W) elements


def totals_lines(memory: list[dict], comm: dict[str, int]) -> list[str]:
    """The end-of-run summary from every rank's figures and the whole run's
    communication (summed over logging intervals, this rank)."""
    shards = sum(m["shard_bytes"] for m in memory)
    state = sum(m["optimizer_state_bytes"] for m in memory)
    per_rank = " ".join(f"r{m['rank']}: shards {_mib(m['shard_bytes'])}, optimizer "
                        f"{_mib(m['optimizer_state_bytes'])}, peak gathered "
                        f"{_mib(m['peak_gathered_bytes'])}, max RSS {_mib(m['max_rss_bytes'])};"
                        for m in memory)
    return [f"sharc: memory {per_rank}",
            f"sharc: totals over {len(memory)} ranks: shards {_mib(shards)} (one copy of the "
            f"model), optimizer state {_mib(state)}; rank 0 sent {_mib(comm['allgather_bytes'])} "
            f"by all-gather and {_mib(comm['reduce_scatter_bytes'])} by reduce-scatter"]
