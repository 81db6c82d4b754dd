"""sharc: ZeRO-3 sharded training for PyTorch with a C++ core."""

from sharc import _library  # noqa: F401  (registers torch.ops.sharc)
from sharc import _compile, _parameter_lookup, _torch_clip
from sharc._compile.graph_breaks import ManyGraphsWarning
from sharc.api import memory_stats, no_sync, reset_memory_stats, shard
from sharc.checkpoint import (full_state_dict, get_state_dict, load_checkpoint,
                              load_full_state_dict, save_checkpoint, set_state_dict)
from sharc.clip import clip_grad_norm_
from sharc.config import CompileConfig, ShardConfig
from sharc.materialize import init_weights
from sharc.mixed_precision import MixedPrecision
from sharc.unsharded import unsharded

_compile.register()  # torch.compile(model, backend="sharc")
_torch_clip.install()  # [Note: torch's clipping on shards]: before any shard()
_parameter_lookup.install()  # [Note: get_parameter gives the shard]

__all__ = [
    "CompileConfig",
    "ManyGraphsWarning",
    "MixedPrecision",
    "ShardConfig",
    "clip_grad_norm_",
    "full_state_dict",
    "get_state_dict",
    "init_weights",
    "load_checkpoint",
    "load_full_state_dict",
    "memory_stats",
    "no_sync",
    "reset_memory_stats",
    "save_checkpoint",
    "set_state_dict",
    "shard",
    "unsharded",
]
