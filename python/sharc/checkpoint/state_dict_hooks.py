"""`module.state_dict()` and `module.load_state_dict()` on a sharded model
speak full tensors, as on the model before shard().

Without these hooks a sharded module's state dict would hold each rank's
flat padded shard under the parameter's original name: saved, it looks like
a checkpoint and is not one. So each module that owns sharded parameters
gets two hooks:

- after `state_dict()`, each of its parameters is replaced by the full
  tensor (a gather: collective, checked like every read outside forward,
  see _rank_check.py);
- before `load_state_dict()`, an entry of the parameter's full shape is
  loaded into the shard (every rank must load the same values: checked by
  checksum before the shard changes) and replaced by the shard itself, so
  torch's own copy changes nothing. An entry of the shard's flat shape (a
  rank's own shard) is left to torch's copy.

Inside `sharc.unsharded(model)` the full tensors it holds are the
parameters: `state_dict()` gives them as they are (with what was written
inside, which the shards do not hold yet; no gather), and a full entry
loads into them, to be written back on exit like any other change there.

sharc's own code reads the shards themselves through `own_state_dict`.
"""

from __future__ import annotations

import contextlib

import torch

from sharc import _rank_check
from sharc._state import ModuleState, state_of, unwrap_compiled
from sharc.eager.schedule import outside_forward_copy


def install(module: torch.nn.Module, state: ModuleState) -> None:
    """Hooks `module`'s state_dict and load_state_dict (its own parameters)."""
    if not state.refs:
        return

    def full_entries(_module, state_dict, prefix, _local_metadata) -> None:
        if state.schedule.raw_state_dict:
            return
        fulls = state.schedule.unsharded  # inside sharc.unsharded(): the full tensors
        for local, ref in state.refs.items():
            key = prefix + local
            if key in state_dict and fulls is not None:
                state_dict[key] = fulls[ref.pid].detach()  # with what was written inside
            elif key in state_dict:
                state.schedule.checks.agree(_rank_check.MODULE_STATE_DICT, f"'{key}'", ref.pid)
                # A copy, as `module.weight` outside forward: an in-place write to
                # it (timm's ModelEmaV2 updates `ema.state_dict().values()` so)
                # would change the copy only, silently; it raises instead.
                state_dict[key] = outside_forward_copy(ref.runtime.read_full(ref.pid), key)

    def load_full_entries(_module, state_dict, prefix, local_metadata, _strict,
                          _missing_keys, _unexpected_keys, error_msgs) -> None:
        if state.schedule.raw_state_dict:
            return
        # load_state_dict(assign=True) assigns each entry as the parameter:
        # the shard itself then, which the shard's own module accepts as an
        # assignment that changes nothing (the values went into it here).
        assign = local_metadata.get("assign_to_params_buffers", False)
        for local, ref in state.refs.items():
            key = prefix + local
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != ref.shape:
                if tuple(value.shape) != tuple(ref.shard.shape):
                    # torch's own message would name the flat shard's shape
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape "
                        f"{value.shape} from checkpoint, the shape in current model is "
                        f"{torch.Size(ref.shape)}.")
                    state_dict[key] = ref.shard if assign else ref.shard.detach()
                continue  # else a rank's own shard, for torch's own copy
            fulls = state.schedule.unsharded
            if fulls is not None:  # inside sharc.unsharded(): loaded as any write there
                with torch.no_grad():
                    fulls[ref.pid].copy_(value)
                # the shard stands for its full tensor there (_shards_as_full.py)
                state_dict[key] = ref.shard if assign else fulls[ref.pid].detach()
                continue
            state.schedule.checks.agree(_rank_check.MODULE_LOAD_STATE_DICT, f"'{key}'",
                                        _rank_check.checksum({key: value}))
            with torch.no_grad():
                ref.runtime.load_full(ref.pid, value)
            state_dict[key] = ref.shard if assign else ref.shard.detach()

    module.register_state_dict_post_hook(full_entries)
    module.register_load_state_dict_pre_hook(load_full_entries)


@contextlib.contextmanager
def _raw(module: torch.nn.Module):
    schedule = state_of(unwrap_compiled(module)).schedule
    before, schedule.raw_state_dict = schedule.raw_state_dict, True
    try:
        yield
    finally:
        schedule.raw_state_dict = before


def own_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict(keep_vars=True)` with the shards themselves (the
    nn.Parameters the optimizer holds), as sharc's own code needs them."""
    with _raw(module):
        return module.state_dict(keep_vars=True)
