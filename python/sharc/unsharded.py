"""sharc.unsharded(): every parameter at its full shape for a while, outside
training, to inspect or change the model."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from sharc import _rank_check
from sharc._fingerprint import fingerprint
from sharc._shards_as_full import ShardsAsFull, shard_lookup
from sharc._state import sharded_root, state_of, unwrap_compiled


@contextlib.contextmanager
def unsharded(module: torch.nn.Module, writeback: bool = False):
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
    """
    if not isinstance(writeback, bool):
        raise TypeError(f"sharc.unsharded: writeback must be a bool, got {writeback!r}")
    root = sharded_root(module)
    root.require_values("sharc.unsharded was entered")
    schedule = state_of(unwrap_compiled(module)).schedule
    if schedule.unsharded is not None:
        raise RuntimeError("sharc.unsharded: this model is already inside sharc.unsharded()")
    refs = list(root.refs_by_shard.values())
    root.checks.agree(_rank_check.UNSHARDED)
    with torch.no_grad():
        fulls = {ref.pid: root.runtime.read_full(ref.pid) for ref in refs}
    # By value, not version counter: writes through `.data` bump no counter.
    before = {pid: fingerprint(t) for pid, t in fulls.items()}
    schedule.unsharded = fulls
    pid_of = shard_lookup(refs)
    try:
        # model.parameters() still yields the shards: they stand for fulls.
        with ShardsAsFull(lambda t: None if (pid := pid_of(t)) is None else fulls[pid]):
            yield module
    finally:
        schedule.unsharded = None
    changed = [ref for ref in refs if fingerprint(fulls[ref.pid]) != before[ref.pid]]
    if writeback:
        _check_same_changes(changed, fulls, root.group)
        with torch.no_grad():
            for ref in changed:
                root.runtime.load_full(ref.pid, fulls[ref.pid])
    elif changed:
        raise RuntimeError(
            f"sharc.unsharded: '{changed[0].fqn}' was changed inside "
            "sharc.unsharded(model) without writeback=True; the change was discarded. "
            "Use `with sharc.unsharded(model, writeback=True):` to keep changes")


def _check_same_changes(changed, fulls, group) -> None:
    """One collective: every rank changed the same parameters to the same
    values (a change made on one rank only would leave each rank's shard
    from a different model)."""
    mine = [(ref.fqn, fingerprint(fulls[ref.pid])) for ref in changed]
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
