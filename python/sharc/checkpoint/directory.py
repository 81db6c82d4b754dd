"""Checkpoint directories that a crash cannot damage.

`save_checkpoint` writes with torch.distributed.checkpoint into a temporary
directory beside `path` and publishes it with a rename by rank 0 once every
rank has finished writing: `path` is either the previous complete checkpoint
or the new complete one, never a half-written one. Beside the files it writes
a manifest of their sizes and blake2b hashes. `load_checkpoint` checks, before
it reads anything, that every file is the one saved (a file swapped with
another rank's, truncated or changed since is named, on every rank) and that
the checkpoint fits the model (naming the first mismatching key and both
shapes) and the optimizer (its parameter groups hold the same parameters):
dcp.load writes straight into the shards and the optimizer's state, so a
mismatch found after it would leave them half loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from sharc._state import sharded_root
from sharc.checkpoint.dcp import check_param_groups, get_state_dict, set_state_dict

EXTRA_FILE = "extra.json"
MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 20


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
    extra_json = _extra_as_json(extra)  # on every rank: rank 0 alone writes it
    tmp = _partial(path)
    if dist.get_rank(group) == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that died
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, process_group=group)
    dist.barrier(group=group)  # every rank's files are complete
    manifest = _hash_files(tmp, sorted(os.listdir(tmp)), group)
    if dist.get_rank(group) == 0:
        with open(os.path.join(tmp, MANIFEST_FILE), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        with open(os.path.join(tmp, EXTRA_FILE), "w") as f:
            f.write(extra_json)
        _publish(tmp, path)
    dist.barrier(group=group)  # nobody reads `path` before it is published


def _extra_as_json(extra: dict | None) -> str:
    """`extra` as the JSON text rank 0 writes, checked on every rank before
    anything is saved: a value JSON cannot hold (a tensor, such as
    torch.get_rng_state()) raised in rank 0's write alone, after the
    shards were saved, while the other ranks returned as if saved and went
    on to their next collective."""
    try:
        return json.dumps(extra or {})
    except (TypeError, ValueError) as e:
        try:
            where = _first_not_json(extra)
        except RecursionError:  # a value that holds itself: json's message says so
            where = None
        raise TypeError(
            f"sharc.save_checkpoint: extra must be JSON-serialisable (numbers, strings, "
            f"bools, None, lists and dicts with string keys), but extra{where or ''} is not "
            f"({e}). Convert tensors with .item() or .tolist(), or save other objects "
            "yourself beside the checkpoint; nothing was saved") from None


def _first_not_json(value, where: str = "") -> str | None:
    """The path (`["rng"]`) of the first value in `value` JSON cannot hold."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{where}[{key!r}] (its key)"
            found = _first_not_json(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_not_json(item, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{where} ({type(value).__name__})"


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
    group = sharded_root(model).group
    check_files(path, group)
    never_stepped = optimizer is not None and not optimizer.state
    try:
        _load_states(path, model, optimizer, group)
    except BaseException:
        if never_stepped:
            # get_state_dict gave the optimizer state to load into (a step
            # with lr 0, its step counts at 1); a refused load takes it
            # back, or the next step would count from 2 (Adam's bias
            # correction) where a fresh optimizer counts from 1.
            optimizer.state.clear()
        raise
    extra_file = os.path.join(path, EXTRA_FILE)
    if not os.path.exists(extra_file):
        return {}
    with open(extra_file) as f:
        return json.load(f)


def _load_states(path: str, model, optimizer, group) -> None:
    """The model's (and optimizer's) state from the checkpoint, after
    checking that it fits them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    check_compatible(path, model_sd, saved)
    if optimizer is not None:
        check_optimizer_groups(path, optim_sd, group, saved)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"] if optimizer is not None else None)


def _existing(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(_previous(path)):  # a save died while publishing
        warnings.warn(f"sharc: {path} is missing; loading {_previous(path)}, the checkpoint "
                      "it replaced", stacklevel=3)
        return _previous(path)
    raise FileNotFoundError(f"no checkpoint at {path}")


def _hash_files(directory: str, names: list[str], group) -> dict[str, list]:
    """{name: [size, blake2b hex]} of `names`; each rank hashes its share
    (every world-th file), and every rank gets the whole. Collective."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {n: _file_digest(os.path.join(directory, n)) for n in names[rank::world]}
    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine, group=group)
    return {n: d for part in everyone for n, d in part.items()}


def _file_digest(file: str) -> list:
    if not os.path.isfile(file):
        return [-1, "missing"]
    h = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return [os.path.getsize(file), h.hexdigest()]


def check_files(path: str, group) -> None:
    """Raises on every rank if a file of the checkpoint differs from the one
    saved (size or hash), or is missing. Checkpoints without a manifest (not
    written by save_checkpoint) are loaded unchecked. Collective."""
    manifest_file = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest_file):
        return
    with open(manifest_file) as f:
        saved = json.load(f)
    found = _hash_files(path, sorted(saved), group)
    bad = [n for n in sorted(saved) if found[n] != saved[n]]
    if bad:
        what = "; ".join(f"'{n}' " + ("is missing" if found[n][0] < 0 else
                                      f"has {found[n][0]} bytes and another hash than the "
                                      f"{saved[n][0]} bytes saved") for n in bad[:4])
        raise ValueError(f"checkpoint {path} is not the one saved: {what}. A file was "
                         "swapped (with another rank's or another checkpoint's), truncated "
                         "or changed since the save; nothing was loaded. Restore the "
                         "checkpoint directory as it was written")


def check_compatible(path: str, model_state_dict: dict, metadata: dict | None = None) -> None:
    """Raises if the checkpoint's model entries differ from the model's:
    the first key (in the model's order) that is missing or has another
    shape, or a key the model lacks. `metadata`: the checkpoint's
    state_dict_metadata, where already read."""
    if metadata is None:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: md for k, md in metadata.items() if k.startswith("model.")}
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


def check_optimizer_groups(path: str, optim_state_dict: dict, group, metadata: dict) -> None:
    """Raises, before anything is loaded, unless the checkpoint's optimizer
    groups list the same parameters as `optim_state_dict`'s (see
    `check_param_groups`). Reads only the groups' name lists."""
    here = optim_state_dict["param_groups"]
    count = len({k.split(".")[2] for k in metadata if k.startswith("optim.param_groups.")})
    if count == 0:
        raise ValueError(f"checkpoint {path} holds no optimizer state (it was saved without "
                         "an optimizer): load it with optimizer=None, or save one with it")
    probe = {"optim": {"param_groups": [{"params": []} for _ in range(count)]}}
    dcp.load(probe, checkpoint_id=path, process_group=group)
    check_param_groups([list(g["params"]) for g in probe["optim"]["param_groups"]],
                       [list(g["params"]) for g in here], f"checkpoint {path}")
