"""Shards whose nn.Parameter died, waiting to be given back
([Note: retired parameters] in src/runtime/runtime.cpp).

A weakref finalizer runs wherever the last reference drops, which may be
inside sharc's C++ runtime while it holds its lock, so the finalizer only
notes the shard here, and the runtime is told at the next safe point:
`shard()` and `memory_stats()`."""

from __future__ import annotations


class DeadShards:
    """(runtime, parameter id) pairs noted dead, not yet retired."""

    def __init__(self) -> None:
        self._noted: list[tuple[object, int]] = []

    def note(self, runtime, pid: int) -> None:
        self._noted.append((runtime, pid))  # one append: safe in any finalizer

    def retire(self) -> None:
        """Gives back every noted shard (one with work still in flight keeps
        its bytes, see Runtime::retire)."""
        while self._noted:
            runtime, pid = self._noted.pop()
            runtime.retire(pid)


DEAD_SHARDS = DeadShards()  # one per process, as the runtimes are
