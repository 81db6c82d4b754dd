"""What an optimizer step wrote, told to the runtime.

[Note: shard writes a version counter misses]
A parameter kept gathered between steps (the compiled schedule's selective
unsharding, ShardConfig.keep_gathered) is gathered again only once its
shard changed, which the runtime reads from the shard's version counter.
Some writes leave that counter where it was: CPU's fused optimizer kernels
(`Adam(fused=True)`, `SGD(fused=True)`, ...) and writes through `.data`
(older optimizers, `p.data.add_(...)`). Kept buffers then went on serving
the values before the step, silently. So after every optimizer step (a
hook on torch.optim.Optimizer, every subclass) the runtime hears which of
its shards the step held, whatever it did to their counters; a write
outside any optimizer step must still move the counter (an in-place op on
the parameter under no_grad, not on `.data`), as the README says.
"""

from __future__ import annotations

import collections
import functools

import torch

from sharc._library import Runtime
from sharc._shard_mark import SHARD_GROUP

SHARD_PID = "_sharc_shard_pid"  # on a shard (nn.Parameter): its id in its group's runtime


def mark_shard(shard: torch.nn.Parameter, pid: int) -> None:
    setattr(shard, SHARD_PID, pid)


def runtimes_of(params):
    """(runtime, ids) for each live group holding shards among `params`;
    other tensors are skipped, and so is a group destroyed since (nothing of
    it is gathered or held any more)."""
    by_group = collections.defaultdict(list)
    for p in params:
        pid = getattr(p, SHARD_PID, None)
        if pid is not None:
            by_group[getattr(p, SHARD_GROUP)].append(pid)
    for group_name, pids in by_group.items():
        try:
            yield Runtime.for_group(group_name), pids
        except RuntimeError:
            continue


def optimizer_params(optimizer):
    return (p for group in optimizer.param_groups for p in group["params"])


def _note_step(optimizer, *_args, **_kwargs) -> None:
    """Optimizer step post-hook: every shard the optimizer holds is reported
    written to its group's runtime."""
    for runtime, pids in runtimes_of(optimizer_params(optimizer)):
        runtime.note_shards_written(pids)


@functools.cache
def install() -> None:
    """Once per process."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_note_step)
