"""A sharded model's state going out and coming in: `module.state_dict()`
speaking full tensors (state_dict_hooks.py), full state dicts and loads
from dicts and files (full_state_dict.py, load.py, load_sources.py), sharded
state dicts for torch.distributed.checkpoint (dcp.py, sharded_view.py) and
crash-safe checkpoint directories (directory.py). See
docs/design/checkpoints.md."""

from sharc.checkpoint.dcp import get_state_dict, set_state_dict
from sharc.checkpoint.directory import load_checkpoint, save_checkpoint
from sharc.checkpoint.full_state_dict import full_state_dict, load_full_state_dict

__all__ = ["full_state_dict", "get_state_dict", "load_checkpoint", "load_full_state_dict",
           "save_checkpoint", "set_state_dict"]
