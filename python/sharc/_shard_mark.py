"""Which parameters are sharc's shards, and over which process group: a mark
that shard() sets on each shard it registers (`_shard._register`).

Its readers are torch's wrapped clipping (`_torch_clip.py`), the clipping
errors (`clip.py`), and the checks of parameters that enter or leave a
sharded model (`_added_after_shard.py`, `_parametrize_removal.py`,
`_optimizer_writes.py`). The mark lives here, apart from all of them, so
that each imports the mark and none imports another for it."""

from __future__ import annotations

import weakref

import torch

SHARD_GROUP = "_sharc_shard_group"  # on a shard (nn.Parameter): its group's name
LIVE_SHARDS: "weakref.WeakSet[torch.nn.Parameter]" = weakref.WeakSet()  # every live shard


def mark_shard(shard: torch.nn.Parameter, group_name: str) -> None:
    setattr(shard, SHARD_GROUP, group_name)
    LIVE_SHARDS.add(shard)
