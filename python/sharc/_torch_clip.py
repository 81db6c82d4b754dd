"""torch.nn.utils.clip_grad_norm_ on sharc's shards.

[Note: torch's clipping on shards]
A training loop written for one process clips with
`torch.nn.utils.clip_grad_norm_`. On shards that would measure each rank's
own slice and scale every rank by a different factor, silently (see
[Note: clipping shards] in clip.py). So shard() wraps torch's function,
once per process: a call given any shard is served by
`sharc.clip_grad_norm_` over the shards' group (the global norm and one
factor on every rank; a collective, every rank calls it, as with FSDP2's
sharded parameters), and a call given no shard goes to torch's function
as it is. Shards beside parameters sharc does not hold, or shards of two
groups, are refused with the error sharc.clip_grad_norm_ gives. Code that
bound torch's function to a name of its own before shard() ran (`from
torch.nn.utils import clip_grad_norm_` at import) keeps torch's; the
README points to sharc.clip_grad_norm_.
"""

from __future__ import annotations

import functools

import torch

from sharc._state import live_group
from sharc.clip import clip_grad_norm_ as sharc_clip

SHARD_GROUP = "_sharc_shard_group"  # on a shard (nn.Parameter): its group's name


def mark_shard(shard: torch.nn.Parameter, group_name: str) -> None:
    setattr(shard, SHARD_GROUP, group_name)


def install() -> None:
    """Wraps torch.nn.utils.clip_grad_norm_ (both names torch exports it by);
    a second call does nothing."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    torch_clip = clip_grad.clip_grad_norm_
    if getattr(torch_clip, "_sharc_wraps", None) is not None:
        return
    wrapped = _wrap(torch_clip)
    clip_grad.clip_grad_norm_ = wrapped
    nn_utils.clip_grad_norm_ = wrapped


def _wrap(torch_clip):
    @functools.wraps(torch_clip)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = list(parameters)  # a generator is read once, here
        groups = {getattr(p, SHARD_GROUP) for p in params if hasattr(p, SHARD_GROUP)}
        if not groups:
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        # Shards of two groups: the first group's check names the others.
        group = live_group(sorted(groups)[0], "these parameters are shards of")
        return sharc_clip(params, max_norm, norm_type, group=group,
                          error_if_nonfinite=error_if_nonfinite)

    clip_grad_norm_._sharc_wraps = torch_clip
    return clip_grad_norm_
