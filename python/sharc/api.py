"""sharc's user-facing calls on a model: shard() and what follows it.

Only hands names on: shard() is _shard.py, the records it leaves on the
model are _state.py, no_sync and the memory figures _runtime_controls.py."""

from sharc._runtime_controls import memory_stats, no_sync, reset_memory_stats
from sharc._shard import shard
from sharc._state import sharded_root, unwrap_compiled

__all__ = ["memory_stats", "no_sync", "reset_memory_stats", "shard", "sharded_root",
           "unwrap_compiled"]
