"""Checks that every rank reached the same collective call, on a side group.

Some sharc calls are collective although they do not look it: reading
`module.weight` outside forward (it gathers), `sharc.full_state_dict`,
`sharc.load_full_state_dict`, `sharc.unsharded`. Called on one rank only
(logging on rank 0, a load guarded by `if rank == 0`), the collective would
pair with whatever the other ranks do next on the model's group: an abort
inside the communication library, or parameters silently mixed.

So each such call first exchanges a small fingerprint (what the rank is
about to do, and for loads a checksum of what it loads) on a gloo group of
its own with a timeout. Nothing else ever runs on that group, so a rank
that comes alone cannot pair with the model's collectives: after the
timeout it raises, naming the call and the rule. Ranks that disagree all
raise, naming what each one was doing. A timed-out exchange leaves the side
group unusable, so later checks raise at once. The exchange pairs calls by
their order: a lone call is caught when no other rank makes a checked call
within the timeout (if one does, the two are compared, and only calls of
the same kind pass).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from sharc._fingerprint import fingerprint

# What a rank is about to do, as the first element exchanged.
(OUTSIDE_READ, FULL_STATE_DICT, LOAD_FULL_STATE_DICT, UNSHARDED, MODULE_STATE_DICT,
 MODULE_LOAD_STATE_DICT, INIT_WEIGHTS, GET_STATE_DICT) = range(8)
_WHAT = {OUTSIDE_READ: "a read of a sharded parameter outside forward",
         FULL_STATE_DICT: "sharc.full_state_dict",
         LOAD_FULL_STATE_DICT: "sharc.load_full_state_dict",
         UNSHARDED: "sharc.unsharded",
         MODULE_STATE_DICT: "state_dict() of a sharded module",
         MODULE_LOAD_STATE_DICT: "load_state_dict() of a sharded module",
         INIT_WEIGHTS: "sharc.init_weights",
         GET_STATE_DICT: "sharc.get_state_dict"}
_FIX = {OUTSIDE_READ: "Read it on every rank (and keep rank 0's value for logging), or read "
                      "this rank's shard (`named_parameters()`), which needs no other rank",
        FULL_STATE_DICT: "Call it on every rank with the same rank0_only (and keep rank 0's "
                         "result to save or log)",
        LOAD_FULL_STATE_DICT: "Call it on every rank, with the same state dict, or with "
                              "from_rank0=True on every rank",
        UNSHARDED: "Enter it on every rank",
        MODULE_STATE_DICT: "Call it on every rank (and keep rank 0's result to save), or "
                           "save a sharded checkpoint with sharc.save_checkpoint",
        MODULE_LOAD_STATE_DICT: "Call it on every rank, with the same state dict",
        INIT_WEIGHTS: "Call it on every rank, with the same init_fn",
        GET_STATE_DICT: "Call it on every rank with the same full and rank0_only"}


class RankCheck:
    """The side group of one sharded model and its checks."""

    def __init__(self, group, timeout_s: float):
        self.timeout_s = timeout_s
        self._side = None
        self._broken = False
        if dist.get_world_size(group) > 1:
            # Only the model's ranks create it (they all call shard()).
            self._side = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout_s),
                                        use_local_synchronization=True)
            # [Note: a group's last handshake]
            # Gloo's connections can be complete on one rank while a peer
            # still reads its handshake; a rank that then exits (an error
            # right after shard(), say) resets them, and the peer fails
            # inside new_group with "Connection closed by peer". The barrier
            # returns only once every rank has its side group.
            dist.barrier(group=self._side)

    def agree(self, kind: int, detail: str = "", value: int = 0) -> None:
        """Every rank must call this with the same `kind` and `value` (a
        parameter id, a checksum); raises RuntimeError otherwise."""
        if self._side is None:
            return
        what = _WHAT[kind] + (f" ({detail})" if detail else "")
        if self._broken:
            raise RuntimeError(f"sharc: {what} cannot be checked: an earlier collective call "
                               "was reached by some ranks only, and the job is out of step")
        mine = torch.tensor([kind, value], dtype=torch.int64)
        world = dist.get_world_size(self._side)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(everyone, mine, group=self._side)
        except RuntimeError as e:
            self._broken = True
            raise RuntimeError(
                f"sharc: {what} is collective: every rank of the model's process group must "
                f"call it at the same point, but not every rank did within "
                f"{self.timeout_s:g} s (ShardConfig.rank_check_timeout_s). {_FIX[kind]}") from e
        if any(not torch.equal(t, mine) for t in everyone):
            raise RuntimeError(f"sharc: the ranks disagree at {what}: "
                               + "; ".join(_describe(r, t) for r, t in enumerate(everyone))
                               + ". Every rank must make the same call with the same input")


def _describe(rank: int, t: torch.Tensor) -> str:
    kind, value = (int(v) for v in t)
    return f"rank {rank} is at {_WHAT.get(kind, kind)} [{value:#x}]"


def checksum(named: dict[str, torch.Tensor]) -> int:
    """An order-sensitive 63-bit hash of names, shapes, dtypes and bytes:
    two entries swapped, or one element changed, give another value."""
    parts: list[str | torch.Tensor] = []
    for name, t in named.items():
        parts += [f"{name}:{tuple(t.shape)}:{t.dtype};", t]
    return fingerprint(*parts)
