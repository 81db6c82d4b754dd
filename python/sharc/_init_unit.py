"""One module's parameters at full size while its initialiser runs: the step
that sharc.init_weights() repeats module by module (see [Note: init replay]
in materialize.py).

A unit gives the module a full-size tensor for each of its own parameters,
in `module._parameters` (for initialisers that iterate `self.parameters()`;
the sharded property returns that very tensor, see [Note: a tensor put in
place of a shard]) and in the eager schedule's `unsharded` table (for reads
of other modules' parameters). A parameter that already has values is
gathered first (an initialiser may read or change only part of it); one
without values starts as a fresh buffer filled with a sentinel. Parameters
of other modules the initialiser reaches (a parent initialising a child's
bias) join the unit on first read, through the attribute or through the
shard itself: an initialiser that walks `self.parameters()` reaches its
submodules' shards, and _shards_as_full.py's mode hands it each one's full
tensor instead (torch's Transformer initialises every matrix of its
layers so, after they initialised themselves). On success each written
parameter is scattered back: this rank keeps its slice, and the full
tensors are dropped. The extra memory is the parameters the initialiser
reached, all at once: one module's, or a whole subtree's for one that walks
it.
"""

from __future__ import annotations

import torch

from sharc._host_memory import give_back_freed_memory
from sharc._shards_as_full import ShardsAsFull, shard_lookup
from sharc._state import state_of

_SENTINEL_BYTE = 0xFF  # NaN in every floating dtype, -1 in integer ones


def fresh(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer whose bytes say so: an initialiser that never
    writes it leaves the sentinel, which `untouched` sees."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        t.fill_(False)  # a bool holding 0xFF is not a valid value
    elif t.numel():
        t.reshape(-1).view(torch.uint8).fill_(_SENTINEL_BYTE)
    return t


def untouched(t: torch.Tensor, version: int) -> bool:
    """Whether a `fresh` buffer was never written. The version counter sees
    writes through the tensor; the sentinel sees writes through `.data`,
    which have a counter of their own."""
    if t.numel() == 0 or t._version != version:
        return False
    return t.dtype == torch.bool or bool(t.reshape(-1).view(torch.uint8).eq(_SENTINEL_BYTE).all())


class InitProgress:
    """Which parameters have values so far, over one init_weights() call."""

    def __init__(self, root, schedule, device: torch.device, owners: dict[int, torch.nn.Module]):
        self.runtime = root.runtime
        self.refs = {ref.pid: ref for ref in root.refs_by_shard.values()}
        self.schedule = schedule
        self.device = device
        self.owners = owners  # parameter id -> the module that created it
        self.pid_of = shard_lookup(self.refs.values())
        self.written: set[int] = set()
        # Parameter id -> in-place writes the initialisers made to it, to set
        # beside the writes construction made (PendingInit.written_when_built).
        self.write_counts: dict[int, int] = {}
        self.copied: set[int] = set()  # took a twin's or a prototype's values

    def run(self, module: torch.nn.Module, fn, as_constructed: bool) -> None:
        """Runs `fn()` (an initialiser of `module`) on a unit of `module`.
        `as_constructed`: as at the module's construction, when a parameter
        it shares with an earlier module (tied) was still its own: the
        initialiser writes a scratch copy and the values are dropped (the
        random numbers are still drawn, as they were then)."""
        give_back_freed_memory(self.device)  # what gloo's threads freed since
        unit = _Unit(self, module, as_constructed)
        unit.open()
        try:
            with ShardsAsFull(unit.full_of_shard):
                fn()
        except BaseException:
            unit.close(write_back=False)
            raise
        unit.close(write_back=True)
        give_back_freed_memory(self.device)

    def full_value(self, pid: int) -> tuple[torch.nn.Parameter, bool]:
        """A full-size tensor for parameter `pid`: its values gathered if it
        has any (collective: every rank initialises the same modules in the
        same order), else a fresh one. Returns it and whether it is fresh."""
        ref = self.refs[pid]
        if pid in self.written:
            full = self.runtime.read_full(pid)
        else:
            full = fresh(ref.shape, ref.shard.dtype, self.device)
        return torch.nn.Parameter(full, requires_grad=False), pid not in self.written

    def gathered(self, pid: int) -> torch.Tensor | None:
        """Parameter `pid`'s full values (collective, as in `full_value`),
        or None while it has none."""
        return self.runtime.read_full(pid) if pid in self.written else None

    def without_values(self) -> list[str]:
        return [ref.fqn for pid, ref in self.refs.items() if pid not in self.written]


class _Unit(dict):
    """Parameter id -> the full tensor `module.<name>` reads in this unit."""

    def __init__(self, progress: InitProgress, module: torch.nn.Module, as_constructed: bool):
        super().__init__()
        self.progress = progress
        self.module = module
        self.as_constructed = as_constructed
        self.targets: dict[int, tuple[torch.nn.Parameter, int, bool]] = {}
        self.originals: dict[str, torch.nn.Parameter] = {}
        self.scratch: dict[int, torch.nn.Parameter] = {}  # see read_through

    def __missing__(self, pid: int) -> torch.nn.Parameter:
        return self._target(pid)  # another module's parameter, reached by this one's init

    def read_through(self, module: torch.nn.Module, pid: int) -> torch.nn.Parameter:
        """`module.<name>` for another module's parameter `pid`, reached by
        this unit's initialiser (a transformers root's `_init_weights`
        writing its output head). Replaying construction, a tied parameter
        reached through a module that did not create it was that module's
        own weight then, which the tie replaced afterwards: the write goes
        to a scratch copy, as for the unit's own module (`open`), and the
        creator's values stand."""
        if self.as_constructed and self.progress.owners[pid] is not module:
            scratch = self.scratch.get(pid)
            if scratch is None:
                ref = self.progress.refs[pid]
                scratch = torch.nn.Parameter(fresh(ref.shape, ref.shard.dtype,
                                                   self.progress.device), requires_grad=False)
                self.scratch[pid] = scratch
            return scratch
        return self[pid]

    def full_of_shard(self, tensor: torch.Tensor) -> torch.nn.Parameter | None:
        """The full tensor a shard the initialiser reached stands for (it
        joins the unit), or None for any other tensor."""
        pid = self.progress.pid_of(tensor)
        return None if pid is None else self[pid]

    def _target(self, pid: int) -> torch.nn.Parameter:
        full, is_fresh = self.progress.full_value(pid)
        self.targets[pid] = (full, full._version, is_fresh)
        self[pid] = full
        return full

    def open(self) -> None:
        state = state_of(self.module)
        for local, ref in (state.refs.items() if state is not None else ()):
            if ref.pid in self:
                full = self[ref.pid]  # one parameter under two local names
            elif self.as_constructed and self.progress.owners[ref.pid] is not self.module:
                full = torch.nn.Parameter(fresh(ref.shape, ref.shard.dtype,
                                                self.progress.device), requires_grad=False)
                self[ref.pid] = full  # scratch: the tie replaced it after construction
            else:
                full = self._target(ref.pid)
            self.originals[local] = self.module._parameters[local]
            self.module._parameters[local] = full
        self.progress.schedule.unsharded = self

    def close(self, write_back: bool) -> None:
        self.progress.schedule.unsharded = None
        self.module._parameters.update(self.originals)
        if not write_back:
            return
        for pid, (full, version, is_fresh) in self.targets.items():
            if is_fresh and untouched(full, version):
                continue  # not this initialiser's parameter; it stays without values
            counts = self.progress.write_counts
            counts[pid] = counts.get(pid, 0) + full._version - version
            self.progress.runtime.load_full(pid, full)
            self.progress.written.add(pid)


class ScratchUnit(dict):
    """Parameter id -> a meta tensor of the parameter's full size: the unit
    of an initialiser run only for what it computes besides parameters (a
    module's non-persistent buffers, when a load has the parameters' values).
    Its writes to parameters land nowhere and take no memory."""

    def __init__(self, refs):
        super().__init__()
        self.refs = {ref.pid: ref for ref in refs}
        self.pid_of = shard_lookup(self.refs.values())

    def __missing__(self, pid: int) -> torch.nn.Parameter:
        ref = self.refs[pid]
        self[pid] = torch.nn.Parameter(
            torch.empty(ref.shape, dtype=ref.shard.dtype, device="meta"), requires_grad=False)
        return self[pid]

    def full_of_shard(self, tensor: torch.Tensor) -> torch.nn.Parameter | None:
        pid = self.pid_of(tensor)
        return None if pid is None else self[pid]


def run_on_scratch(root, schedule, module: torch.nn.Module, fn) -> None:
    """Runs `fn()` (an initialiser of `module`) with every parameter it
    reaches standing as a meta tensor, so that only its buffer writes take
    effect. Communicates nothing."""
    unit = ScratchUnit(root.refs_by_shard.values())
    state = state_of(module)
    originals = {}
    for local, ref in (state.refs.items() if state is not None else ()):
        originals[local] = module._parameters[local]
        module._parameters[local] = unit[ref.pid]
    schedule.unsharded = unit
    try:
        with ShardsAsFull(unit.full_of_shard):
            fn()
    finally:
        schedule.unsharded = None
        module._parameters.update(originals)
