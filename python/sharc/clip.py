"""Gradient clipping by the norm of the whole (unsharded) gradient.

[Note: clipping shards]
After shard(), each rank's `.grad` holds only its slice of each gradient, so
`torch.nn.utils.clip_grad_norm_` would measure a different, partial norm on
every rank and scale every rank differently. Here each rank sums the p-th
powers of its shards' elements, one all-reduce (SUM; MAX for the inf-norm)
over the group gives the p-th power of the global norm, and every rank
scales its shards by the same coefficient. The padding at the end of a shard
holds zero gradients, which add nothing to a p-norm (p > 0) or a max.

A parameter that is not a shard of the group (never passed through shard(),
or sharded over another group) has a whole gradient on every rank: counted
on each rank it would be counted W times, so mixing is an error.

Hybrid sharding: the norm is summed over the shard group only. After the
replicate all-reduce every replica holds the same shard gradients, so each
shard group already sees every element of every gradient exactly once;
summing over the world would count each element R times. Every replica
computes the same norm from the same shards and scales them alike, so the
replicas stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from sharc import _mesh, _validate
from sharc._library import Runtime
from sharc._shard_mark import SHARD_GROUP
from sharc._shards_as_full import ShardsAsFull
from sharc._state import sharded_root, unwrap_compiled


def clip_grad_norm_(parameters: torch.nn.Module | Iterable[torch.Tensor] | torch.Tensor,
                    max_norm: float, norm_type: float = 2.0, group=None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clips the gradients of sharded parameters by their global norm, in place.

    Like `torch.nn.utils.clip_grad_norm_` on the unsharded model: the norm is
    that of all gradients together across every rank of `group` (default:
    the world), and every shard is scaled by the same factor
    `min(1, max_norm / (norm + 1e-6))`. Takes a sharded module or its
    parameters; returns the total norm (a 0-dim tensor, the same on every
    rank). Collective: every rank of the group must call it. `norm_type` is
    a positive number or `inf`. With `error_if_nonfinite`, a NaN or infinite
    norm raises on every rank. See [Note: clipping shards].

    `group` may be a hybrid mesh (its shard group is used); left None with a
    sharded module, the group the module was sharded over (the shard group
    of a hybrid mesh), else the world.
    """
    group = _group_for(parameters, group)
    params = _parameter_list(parameters)
    max_norm, p = _check_norm_args(max_norm, norm_type)
    problem = _shard_problem(params, group)
    # Where some are no shards the collective only spreads the error, and a
    # copy read outside forward (`[model.fc.weight]`) refuses a read of its
    # `.grad` ([Note: a copy has no gradient of training's]): none is read.
    grads = [] if problem else [t.grad for t in params if t.grad is not None]
    total = global_norm(grads, p, group, problem, error_if_nonfinite)
    coef = max_norm / (total + 1e-6)
    if not coef >= 1.0:  # a NaN norm makes every gradient NaN, as in torch
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return as_norm_tensor(total, grads, group)


def global_norm(grads: list[torch.Tensor], p: float, group, problem: str | None,
                error_if_nonfinite: bool) -> float:
    """The p-norm of every rank's shard gradients `grads` together (one
    collective over `group`, which every rank joins, `problem` or not: a
    rank that found one raises it, the others a pointer to it)."""
    device = grads[0].device if grads else _validate.group_device(group)
    total = _all_reduce(_local_norm_power(grads, p, device), problem, p, group)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is {total}, so they cannot "
            "be clipped; find where the NaN or inf comes from (e.g. a too high learning rate, "
            "or torch.autograd.set_detect_anomaly(True)), or pass error_if_nonfinite=False")
    return total


def as_norm_tensor(total: float, grads: list[torch.Tensor], group) -> torch.Tensor:
    """The norm as torch returns it: a 0-dim tensor in the gradients' dtype."""
    dtype = grads[0].dtype if grads else torch.get_default_dtype()
    device = grads[0].device if grads else _validate.group_device(group)
    return torch.tensor(total, dtype=dtype, device=device)


def _group_for(parameters, group):
    if group is None and isinstance(parameters, torch.nn.Module):
        try:
            return sharded_root(unwrap_compiled(parameters)).group
        except RuntimeError:
            pass  # not sharded: the world, and the shard check below says what is wrong
    return _mesh.shard_group_of(group, "sharc.clip_grad_norm_()")


def _parameter_list(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    params = list(parameters)
    for t in params:
        if not isinstance(t, torch.Tensor):
            raise TypeError("sharc.clip_grad_norm_() takes a sharded module, or its "
                            f"parameters (tensors), got an element of type {type(t).__name__}")
    return params


def _check_norm_args(max_norm, norm_type) -> tuple[float, float]:
    try:
        max_norm, p = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError("sharc.clip_grad_norm_(): max_norm and norm_type must be numbers, got "
                        f"{max_norm!r} and {norm_type!r}") from None
    if not p > 0:  # also rejects NaN
        raise ValueError(
            f"sharc.clip_grad_norm_(): norm_type must be a positive number or inf, got "
            f"{norm_type!r} (a shard's zero padding would change a minimum or a 0-norm)")
    if not max_norm >= 0:
        raise ValueError(f"sharc.clip_grad_norm_(): max_norm must be >= 0, got {max_norm!r}")
    return max_norm, p


def _shard_storages(group) -> set[int]:
    """The data pointers of every shard the group's runtime holds."""
    runtime = Runtime.for_group(group.group_name)
    ptrs, pid = set(), 0
    while True:  # ids are dense from 0; the first unknown id raises
        try:
            shard = runtime.shard(pid)
        except RuntimeError:
            return ptrs
        ptrs.add(shard.untyped_storage().data_ptr())
        pid += 1


def _shard_problem(params: list[torch.Tensor], group) -> str | None:
    """What makes these parameters unfit for clipping over `group`, or None."""
    if ShardsAsFull.entered:
        return ("sharc.clip_grad_norm_() was called inside sharc.unsharded() (or an "
                "initialiser sharc.init_weights() runs), where the shards stand for full "
                "tensors; clip after the `with` block")
    shards = _shard_storages(group)
    foreign = [i for i, t in enumerate(params) if t.untyped_storage().data_ptr() not in shards]
    if not foreign:
        return None
    others = sorted({getattr(params[i], SHARD_GROUP) for i in foreign
                     if hasattr(params[i], SHARD_GROUP)})
    if others:
        # Models sharded over different groups (one over the world, one over
        # a subgroup) in one call: no one group's collective takes their norm.
        return (f"{len(foreign)} of the {len(params)} parameters given are shards of "
                f"another process group ({', '.join(repr(g) for g in others)}) than the "
                f"others' ('{group.group_name}'): no one group's collective takes the norm of "
                "parameters sharded over different groups. Clip each sharded model over its "
                "own group (sharc.clip_grad_norm_(model_a, ...), sharc.clip_grad_norm_("
                "model_b, ...)), or for one norm of both, combine the norms each returns "
                "with max_norm=inf and scale the gradients yourself")
    t = params[foreign[0]]
    return (f"{len(foreign)} of the {len(params)} parameters given (the first: #{foreign[0]}, "
            f"shape {tuple(t.shape)}) are not shards of group '{group.group_name}': "
            "sharc.clip_grad_norm_() clips only parameters sharded by sharc.shard() over "
            "that group (pass group= the group given to shard(), or the mesh, or the sharded "
            "module itself); clip parameters that were "
            "not sharded separately, with torch.nn.utils.clip_grad_norm_")


def _local_norm_power(grads: list[torch.Tensor], p: float, device) -> torch.Tensor:
    """This rank's share, in float64 on `device`: the sum of |g|^p over its
    shards' elements (the largest |g| for the inf-norm)."""
    norms = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64).to(device)
             for g in grads if g.numel()]
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack(norms)
    return norms.max() if math.isinf(p) else norms.pow(p).sum()


def _all_reduce(local: torch.Tensor, problem: str | None, p: float, group) -> float:
    """One collective whatever happens: the value, a NaN flag and an error
    flag, so a rank that finds a problem fails together with the others,
    never leaving them waiting in a collective it skipped."""
    nan = torch.isnan(local)
    flag = torch.full_like(local, 1.0 if problem else 0.0)
    buf = torch.stack([torch.where(nan, torch.zeros_like(local), local), nan.double(), flag])
    dist.all_reduce(buf, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                    group=group)
    value, any_nan, any_problem = buf.tolist()
    if problem:
        raise ValueError(problem)
    if any_problem > 0:
        raise ValueError("sharc.clip_grad_norm_(): another rank was given parameters that "
                         "are not shards of this group; its error says which")
    if any_nan > 0:
        return math.nan
    return value if math.isinf(p) else value ** (1.0 / p)
