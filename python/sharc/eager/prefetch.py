"""Eager prefetch: the next module's gathers start while the current one runs.

[Note: eager prefetch]
The eager schedule gathers a parameter when code reads it, one blocking
collective per parameter. After the first step the order is known: each pass
(forward, backward) records its gathers as groups — in forward the
parameters first gathered inside one module's forward, in backward the
parameters of one forward group in the order backward asked for them. In
the next pass the first gather of a recorded group starts that group's
gathers as one bucketed collective and the next group's as another, through
the runtime's own `start_gather`; the reads then wait on collectives already
in flight. So one group is gathered ahead, as a module-granular prefetch,
and a group costs one collective instead of one per parameter.

Every rank must issue the same collectives in the same order. The trigger
is a gather the code asked for, never a module being entered, so modules
that run on some ranks only (the experts of a gather unit) move nothing;
parameters of gather units are left out altogether (their unit gathers
them). A recorded group whose parameters the pass does not read after all
(another path through the model) was gathered for nothing: the end of the
pass frees what nobody took (`Runtime.drop_unheld`), so nothing stays
gathered, and the pass's own order becomes the one the next pass follows.
"""

from __future__ import annotations


class _Recording:
    """The groups of one pass in the order their first gather came."""

    __slots__ = ("groups", "where", "keys")

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.where: dict[int, int] = {}  # parameter id -> its group's index
        self.keys: dict[object, int] = {}  # grouping key -> its group's index

    def add(self, key, pid: int) -> None:
        if pid in self.where:
            return  # gathered again (a tied or re-read weight): its first group stands
        index = self.keys.get(key)
        if index is None:
            index = self.keys[key] = len(self.groups)
            self.groups.append([])
        self.groups[index].append(pid)
        self.where[pid] = index


class PassPrefetch:
    """Prefetch for one kind of pass (forward or backward) of one sharded root."""

    def __init__(self, runtime, excluded: set[int]):
        self._runtime = runtime  # None: prefetch switched off (nothing recorded)
        self._excluded = excluded  # parameters of gather units
        self._last: _Recording | None = None  # the previous pass's groups
        self._now = _Recording()
        self._started: set[int] = set()  # groups of _last started in this pass
        self._touched: list[int] = []  # parameters this pass started gathering

    def group_of(self, pid: int) -> int | None:
        """The group `pid` belonged to in the last finished pass."""
        return None if self._last is None else self._last.where.get(pid)

    def on_gather(self, key, pid: int) -> None:
        """The code is about to gather `pid` (grouped by `key` in this pass):
        record it, and start its group and the next one if not started yet."""
        if self._runtime is None or pid in self._excluded:
            return
        self._now.add(key, pid)
        group = self.group_of(pid)
        if group is None:
            return
        for index in (group, group + 1):
            if index < len(self._last.groups) and index not in self._started:
                self._started.add(index)
                ids = self._last.groups[index]
                self._runtime.start_gather(ids)
                self._touched.extend(ids)

    def finish(self) -> None:
        """The pass is over: frees what it prefetched and nobody took, and
        keeps its order for the next pass (a pass that gathered nothing,
        such as a backward without sharded inputs, keeps the old one)."""
        if self._touched:
            self._runtime.drop_unheld(self._touched)
        if self._now.groups:
            self._last = self._now
        self._now = _Recording()
        self._started = set()
        self._touched = []
