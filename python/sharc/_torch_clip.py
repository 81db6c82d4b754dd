"""torch.nn.utils.clip_grad_norm_ on sharc's shards.

[Note: torch's clipping on shards]
A training loop written for one process clips with
`torch.nn.utils.clip_grad_norm_`. On shards that would measure each rank's
own slice and scale every rank by a different factor, silently (see
[Note: clipping shards] in clip.py). So `import sharc` wraps torch's
functions, once per process: a clip_grad_norm_ call given any shard is
served by `sharc.clip_grad_norm_` over the shards' group (the global norm
and one factor on every rank; a collective, every rank calls it, as with
FSDP2's sharded parameters), and a call given no shard goes to torch's
function as it is. Code that bound torch's function to a name of its own
before `import sharc` still reaches the norm through the module global
torch's function reads at each call (`_get_total_norm`), which is wrapped
too, as is `torch.nn.utils.get_total_norm`: given shard gradients, their
norm across the group. Shards beside parameters sharc does not hold, or
shards of two groups, are refused with the error sharc.clip_grad_norm_
gives.
"""

from __future__ import annotations

import functools

import torch

from sharc._shard_mark import LIVE_SHARDS, SHARD_GROUP
from sharc._state import live_group
from sharc.clip import as_norm_tensor, clip_grad_norm_ as sharc_clip
from sharc.clip import _check_norm_args as check_norm_args, global_norm as sharc_norm


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
    # torch's clip_grad_norm_ reads this module global at every call, so even
    # a name bound to torch's function before this ran measures shards whole.
    torch_norm = getattr(clip_grad, "_get_total_norm", None)  # torch >= 2.6
    if torch_norm is None:
        return
    norm = _wrap_total_norm(torch_norm)
    clip_grad._get_total_norm = norm
    if getattr(nn_utils, "get_total_norm", None) is not None:
        nn_utils.get_total_norm = norm


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


def _wrap_total_norm(torch_norm):
    """torch.nn.utils.get_total_norm, and the norm torch's clip_grad_norm_
    takes (however the caller bound it): given shard gradients, their norm
    across the group, the same on every rank; given none, torch's."""

    @functools.wraps(torch_norm)
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = {id(p.grad): p for p in list(LIVE_SHARDS) if p.grad is not None}
        shards = [owners.get(id(t)) for t in tensors]
        groups = sorted({getattr(p, SHARD_GROUP) for p in shards if p is not None})
        if not groups:
            return torch_norm(tensors, norm_type, error_if_nonfinite, foreach)
        group = live_group(groups[0], "these gradients' parameters are shards of")
        foreign = [i for i, p in enumerate(shards)
                   if p is None or getattr(p, SHARD_GROUP) != groups[0]]
        problem = None if not foreign else (
            f"{len(foreign)} of the {len(tensors)} gradients given to get_total_norm (the "
            f"first: #{foreign[0]}, shape {tuple(tensors[foreign[0]].shape)}) are not "
            f"gradients of shards of group '{groups[0]}', beside others that are: a shard "
            "holds a slice of its gradient, another tensor a whole one, so no norm of them "
            "together is meaningful; take the norms of shards and other gradients apart")
        _, p = check_norm_args(0.0, norm_type)
        total = sharc_norm(tensors, p, group, problem, error_if_nonfinite)
        return as_norm_tensor(total, tensors, group)

    get_total_norm._sharc_wraps = torch_norm
    return get_total_norm
