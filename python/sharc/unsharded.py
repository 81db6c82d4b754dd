"""sharc.unsharded(): every parameter at its full shape for a while, outside
training, to inspect or change the model."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sharc import _full_grads, _rank_check
from sharc._fingerprint import fingerprint
from sharc._shards_as_full import ShardsAsFull, shard_lookup
from sharc._state import sharded_root, state_of, unwrap_compiled


@contextlib.contextmanager
def unsharded(module: torch.nn.Module, writeback: bool = False, with_grads: bool = False):
    """Inside, `module.<name>` is one full tensor per parameter, in the
    master dtype, the same tensor at every read (so `nn.init.*_`,
    `.copy_()`, `.data.fill_()` act on it); the shards that
    `module.parameters()` yields stand for those full tensors in every
    torch function and Tensor method (a loop `for p in model.parameters():
    nn.init.normal_(p)` writes the full parameters). With `writeback=True` each
    parameter is scattered back into the shards on exit; without it, a
    parameter changed inside raises on exit (the change is discarded). Every
    rank must make the same changes: on exit with writeback the ranks
    compare hashes of what they changed and all raise, naming the first
    parameter that differs, before writing anything back. Not
    for training: the full tensors do not pass gradients to the shards.
    Holds every full parameter at once (the whole model's bytes).
    Collective: every rank must enter and leave it alike (checked on entry:
    a rank that enters alone raises).

    With `with_grads=True` each full parameter's `.grad` (and, in the loop
    over `model.parameters()`, each shard's) is the whole averaged gradient,
    gathered from the shards' gradients (None where no rank has one), to
    read per-layer gradient norms or change gradients by their full shape;
    changed gradients follow the same rule as parameters (written back to
    the shards' `.grad` with writeback=True, else an error on exit). Holds
    the model's gradient bytes too. The gradients are those the shards hold:
    inside sharc.no_sync(), before the backward that synchronizes, not yet
    the whole gradient. An optimizer step or sharc.clip_grad_norm_() inside
    sharc.unsharded() raises (step and clip after it).
    """
    for name, value in (("writeback", writeback), ("with_grads", with_grads)):
        if not isinstance(value, bool):
            raise TypeError(f"sharc.unsharded: {name} must be a bool, got {value!r}")
    root = sharded_root(module)
    root.require_values("sharc.unsharded was entered")
    schedule = state_of(unwrap_compiled(module)).schedule
    if schedule.unsharded is not None:
        raise RuntimeError("sharc.unsharded: this model is already inside sharc.unsharded()")
    refs = list(root.refs_by_shard.values())
    root.checks.agree(_rank_check.UNSHARDED, value=int(with_grads))
    with torch.no_grad():
        fulls = {ref.pid: root.runtime.read_full(ref.pid) for ref in refs}
        if with_grads:
            _full_grads.gather(refs, fulls, root.group)
    # By value, not version counter: writes through `.data` bump no counter.
    before = {pid: _digest(t, with_grads) for pid, t in fulls.items()}
    schedule.unsharded = fulls
    pid_of = shard_lookup(refs)
    no_steps = register_optimizer_step_pre_hook(
        _refuse_steps_on({id(ref.shard) for ref in refs}))
    try:
        # model.parameters() still yields the shards: they stand for fulls.
        with ShardsAsFull(lambda t: None if (pid := pid_of(t)) is None else fulls[pid],
                          full_grads=with_grads):
            yield module
    finally:
        schedule.unsharded = None
        no_steps.remove()
    after = {pid: _digest(t, with_grads) for pid, t in fulls.items()}
    changed = [ref for ref in refs if after[ref.pid][0] != before[ref.pid][0]]
    grads_changed = [ref for ref in refs if after[ref.pid][1] != before[ref.pid][1]]
    if writeback:
        _check_same_changes([(ref.fqn, after[ref.pid][0]) for ref in changed]
                            + [(ref.fqn + ".grad", after[ref.pid][1]) for ref in grads_changed],
                            root.group)
        with torch.no_grad():
            for ref in changed:
                root.runtime.load_full(ref.pid, fulls[ref.pid])
            _full_grads.write_back(grads_changed, fulls, root.group)
    elif changed or grads_changed:
        what = (f"'{changed[0].fqn}'" if changed
                else f"the gradient of '{grads_changed[0].fqn}'")
        raise RuntimeError(
            f"sharc.unsharded: {what} was changed inside "
            "sharc.unsharded(model) without writeback=True; the change was discarded. "
            "Use `with sharc.unsharded(model, writeback=True):` to keep changes")


def _refuse_steps_on(shard_ids: set[int]):
    """An optimizer step pre-hook refusing a step over these shards: inside
    sharc.unsharded() the step would act on the full tensors (with_grads:
    and their full gradients) and make full-shaped optimizer state."""
    def refuse(optimizer, args, kwargs):
        if any(id(p) in shard_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError("sharc.unsharded: optimizer.step() was called inside "
                               "sharc.unsharded(), where the shards stand for full tensors; "
                               "step after the `with` block")
    return refuse


def _digest(full: torch.Tensor, with_grads: bool) -> tuple:
    """(the value's fingerprint, its gradient's or None)."""
    grad = full.grad if with_grads else None
    return fingerprint(full), None if grad is None else fingerprint(grad)


def _check_same_changes(mine: list[tuple[str, int | None]], group) -> None:
    """One collective: every rank changed the same parameters (and
    gradients) to the same values (a change made on one rank only would
    leave each rank's shard from a different model)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            names = dict(everyone[0])
            differ = [n for n, d in theirs if names.get(n) != d] + \
                [n for n in names if n not in dict(theirs)]
            raise RuntimeError(
                f"sharc.unsharded: ranks 0 and {rank} changed the parameters differently "
                f"(first: '{differ[0]}'); nothing was written back. Make the same changes "
                "on every rank (seed random initializers identically)")
