"""Checkpoint directories that a crash cannot damage.

`save_checkpoint` writes with torch.distributed.checkpoint into a temporary
directory beside `path` and publishes it with a rename by rank 0 once every
rank has finished writing: `path` is either the previous complete checkpoint
or the new complete one, never a half-written one. `load_checkpoint` checks
that the checkpoint fits the model (naming the first mismatching key and both
shapes) before it reads anything.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from sharc.api import sharded_root
from sharc.checkpoint import get_state_dict, set_state_dict

EXTRA_FILE = "extra.json"


def _partial(path: str) -> str:
    return f"{path}.partial"


def _previous(path: str) -> str:
    return f"{path}.previous"


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> None:
    """Saves the sharded model (and optimizer) to directory `path`, each rank
    writing only its shards; `extra` (JSON-serialisable, e.g. the step
    counter) is written by rank 0 beside them. Collective. An existing `path`
    is replaced only once the new checkpoint is complete."""
    path = os.fspath(path)
    group = sharded_root(model).group
    tmp = _partial(path)
    if dist.get_rank(group) == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that died
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, process_group=group)
    dist.barrier(group=group)  # every rank's files are complete
    if dist.get_rank(group) == 0:
        with open(os.path.join(tmp, EXTRA_FILE), "w") as f:
            json.dump(extra or {}, f)
        _publish(tmp, path)
    dist.barrier(group=group)  # nobody reads `path` before it is published


def _publish(tmp: str, path: str) -> None:
    """Renames `tmp` to `path`. A directory cannot be renamed over a
    non-empty one, so an old `path` steps aside to `path.previous` first;
    a crash between the two renames leaves it there, where
    `load_checkpoint` looks next."""
    if os.path.exists(path):
        if os.path.exists(_previous(path)):
            shutil.rmtree(_previous(path))
        os.rename(path, _previous(path))
    os.rename(tmp, path)
    if os.path.exists(_previous(path)):
        shutil.rmtree(_previous(path))


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Loads a checkpoint written by `save_checkpoint` (on any number of
    ranks) into the sharded model (and optimizer); returns its `extra`.
    Collective."""
    path = _existing(os.fspath(path))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_compatible(path, model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    group = sharded_root(model).group
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"] if optimizer is not None else None)
    extra_file = os.path.join(path, EXTRA_FILE)
    if not os.path.exists(extra_file):
        return {}
    with open(extra_file) as f:
        return json.load(f)


def _existing(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(_previous(path)):  # a save died while publishing
        warnings.warn(f"sharc: {path} is missing; loading {_previous(path)}, the checkpoint "
                      "it replaced", stacklevel=3)
        return _previous(path)
    raise FileNotFoundError(f"no checkpoint at {path}")


def check_compatible(path: str, model_state_dict: dict) -> None:
    """Raises if the checkpoint's model entries differ from the model's:
    the first key (in the model's order) that is missing or has another
    shape, or a key the model lacks."""
    saved = {k[len("model."):]: md for k, md in FileSystemReader(path).read_metadata()
             .state_dict_metadata.items() if k.startswith("model.")}
    for name, value in model_state_dict.items():
        if name not in saved:
            raise ValueError(f"checkpoint {path} does not fit this model: it has no entry "
                             f"'{name}'; load it into the architecture it was saved from")
        md = saved[name]
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.size()):
            raise ValueError(f"checkpoint {path} does not fit this model: '{name}' has shape "
                             f"{tuple(md.size)} in the checkpoint and {tuple(value.size())} in "
                             "the model; load it into the architecture it was saved from")
    extra = [k for k in saved if k not in model_state_dict]
    if extra:
        raise ValueError(f"checkpoint {path} does not fit this model: it has '{extra[0]}', "
                         "which the model lacks; load it into the architecture it was saved "
                         "from")
