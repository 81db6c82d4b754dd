"""sharc: ZeRO-3 sharded training for PyTorch with a C++ core."""

from sharc import _library  # noqa: F401  (registers torch.ops.sharc)
from sharc.api import memory_stats, reset_memory_stats, shard
from sharc.config import ShardConfig
from sharc.state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "ShardConfig",
    "full_state_dict",
    "load_full_state_dict",
    "memory_stats",
    "reset_memory_stats",
    "shard",
]
