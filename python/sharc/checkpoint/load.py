"""Full values into shards: what sharc.load_full_state_dict does, from a
state dict or straight from a file (load_sources.py), into a model sharded
from the meta device or from real values.

Every key's name, shape and dtype is checked against the model before
anything is written (from the file's metadata: identical on every rank, so
every rank raises alike), and the ranks agree on what they load. Then, one
tensor at a time, each rank copies its slice of each parameter into its
shard and each buffer whole. A tied parameter needs one of its names (a
safetensors file keeps only one). A model built on the meta device gets its
buffers allocated; non-persistent ones (absent from files) are computed
again by their module's `reset_buffers()` or, in a Hugging Face model, its
own initialisation; after that it has its values (see
docs/design/meta-init.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sharc import _hf_init, _rank_check
from sharc._flat_chunks import owned_range
from sharc._host_memory import give_back_freed_memory
from sharc._init_unit import run_on_scratch
from sharc._meta_buffers import MetaBuffers, has_reset_buffers
from sharc._state import sharded_root, state_of, unwrap_compiled
from sharc.checkpoint.load_sources import open_source
from sharc.checkpoint.rank0_source import Rank0Source
from sharc.checkpoint.state_dict_hooks import own_state_dict


_TRIM_AFTER_BYTES = 1 << 20  # smaller reads come from the heaps' free lists anyway


@dataclass(slots=True)
class _Target:
    """One tensor of the model: a sharded parameter or a buffer, under all
    its names, and the key of the source it loads from."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    ref: object = None  # ShardedParamRef of a parameter; None for a buffer
    key: str | None = None


# The rank check's value for a load from rank 0: no checksum (a 63-bit
# hash, never negative) takes it, so a rank loading its own state dict while
# another loads from rank 0 makes every rank raise.
_FROM_RANK0 = -1


def load(module: torch.nn.Module, given, from_rank0: bool = False) -> None:
    """sharc.load_full_state_dict (see its docstring in full_state_dict.py)."""
    root = sharded_root(module)
    model = unwrap_compiled(module)
    targets = _targets(model, root)
    if from_rank0:
        source = _rank0_source(given, root, targets)
    else:
        source = open_source(given)
    _match(targets, source, _hf_init.converts_checkpoints(model))
    pending = root.pending_init
    buffers = MetaBuffers(model) if pending is not None else None
    if buffers is not None:
        _check_recomputable(buffers, model)
    if not from_rank0:  # agreed on before rank 0 sent anything
        root.checks.agree(_rank_check.LOAD_FULL_STATE_DICT,
                          value=source.fingerprint([t.key for t in targets]))
    if buffers is not None:
        buffers.allocate(pending.device)
    _write(targets, source, model, root.group)
    if buffers is not None:
        _recompute(buffers, model)
        buffers.raise_without_values("sharc.load_full_state_dict")
        root.pending_init = None
        pending.finish()


def _rank0_source(given, root, targets: list[_Target]) -> Rank0Source:
    """The source of a load from rank 0, after every rank has agreed to
    one (a rank check, so a rank that loads otherwise, or not at all, makes
    every rank raise instead of waiting on rank 0's first broadcast)."""
    if root.runtime.replicate_size() > 1:
        raise ValueError("load_full_state_dict(from_rank0=True) is for flat sharding; under "
                         "hybrid sharding every replica's shard group needs the values: pass "
                         "the state dict or file on every rank (from_rank0=False)")
    root.checks.agree(_rank_check.LOAD_FULL_STATE_DICT, "from rank 0", value=_FROM_RANK0)
    # The group's collectives run on its shards' device (gloo: CPU, NCCL: CUDA).
    device = next((t.ref.shard.device for t in targets if t.ref is not None),
                  torch.device("cpu"))
    return Rank0Source(given, root.group, device)


def _targets(model, root) -> list[_Target]:
    by_tensor: dict[int, _Target] = {}
    for name, value in own_state_dict(model).items():
        target = by_tensor.get(id(value))
        if target is None:
            ref = root.refs_by_shard.get(id(value))
            shape = ref.shape if ref is not None else tuple(value.shape)
            target = by_tensor[id(value)] = _Target([], shape, value.dtype, ref)
        target.names.append(name)
    return list(by_tensor.values())


def _match(targets: list[_Target], source, converted_type: str | None = None) -> None:
    """Picks each target's key; raises before anything is written on a
    missing, unexpected or mismatched key, naming it (and, for a transformers
    model whose checkpoints transformers converts on load, `converted_type`,
    how to load such a file)."""
    keys = set(source.keys())
    known = {name for t in targets for name in t.names}
    missing = [t.names[0] for t in targets if not keys & set(t.names)]
    unexpected = sorted(keys - known)
    if missing or unexpected:
        hint = "" if converted_type is None or not unexpected else (
            f"; transformers converts '{converted_type}' checkpoints while loading them "
            "(renamed keys, per-expert tensors merged), which sharc does not: load such a "
            "checkpoint with from_pretrained() into an unsharded model and pass its "
            "state_dict() (or a file of it saved with torch.save or safetensors)")
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}{hint}")
    for t in targets:
        t.key = next(n for n in t.names if n in keys)
        for key in (n for n in t.names if n in keys):
            source.check_tensor(key)
            if source.shape(key) != t.shape:
                raise ValueError(f"load_full_state_dict: '{key}' has shape "
                                 f"{source.shape(key)}, the module expects {t.shape}")
            if source.dtype(key) != t.dtype:
                raise ValueError(f"load_full_state_dict: '{key}' has dtype {source.dtype(key)}, "
                                 f"the module expects {t.dtype}; convert the values (or build "
                                 "the model in that dtype) first")


def _write(targets: list[_Target], source, model, group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    current = own_state_dict(model)  # buffers allocated since _targets()
    with torch.no_grad():
        for t in targets:
            if t.ref is None:
                current[t.names[0]].copy_(source.read(t.key))
                source.done_with(current[t.names[0]].nbytes)
                continue
            lo, hi = owned_range(math.prod(t.shape), world, rank)
            if hi > lo or source.collective:  # a rank owning nothing still joins in
                t.ref.shard[:hi - lo].copy_(source.read_range(t.key, lo, hi))
            nbytes = (hi - lo) * t.ref.shard.element_size()
            source.done_with(nbytes)
            if nbytes >= _TRIM_AFTER_BYTES:
                give_back_freed_memory(torch.device("cpu"))  # the slice just read


def _recompute_plan(buffers: MetaBuffers, model):
    """(module, how) for each module holding a non-persistent meta buffer, a
    file never has: its reset_buffers(), or its Hugging Face model's
    initialisation (`position_ids`, `embed_scale`), run with the module's
    parameters as meta stand-ins so that the values just loaded stay
    untouched; None if neither."""
    hf_owners = _hf_init.owners(model)
    root = sharded_root(model)
    schedule = state_of(model).schedule
    plan, seen = [], set()
    for buf in buffers.buffers:
        if buf.persistent:
            continue
        module = buf.places[0][0]
        if id(module) in seen:
            continue
        seen.add(id(module))
        if has_reset_buffers(module):
            plan.append((buf, module, module.reset_buffers))
        elif id(module) in hf_owners:
            owner = hf_owners[id(module)]
            plan.append((buf, module, functools.partial(
                run_on_scratch, root, schedule, module,
                functools.partial(_hf_init.recompute_buffers, owner, module))))
        else:
            plan.append((buf, module, None))
    return plan


def _check_recomputable(buffers: MetaBuffers, model) -> None:
    for buf, module, how in _recompute_plan(buffers, model):
        if how is None:
            cls = getattr(module, "_sharc_original_class", type(module)).__name__
            raise RuntimeError(
                f"load_full_state_dict: the non-persistent buffer '{buf.fqn}' ({cls}) is in no "
                "state dict and was computed on the meta device when the model was built; "
                f"give {cls} a reset_buffers() that fills it in place (and call it from "
                "__init__), or build the model with that buffer on a real device")


def _recompute(buffers: MetaBuffers, model) -> None:
    with torch.no_grad():
        for _, _, how in _recompute_plan(buffers, model):
            how()


def values_for_meta_built(module, state_dict, prefix, local_metadata, *_) -> None:
    """A root's load_state_dict pre-hook, registered before state_dict_hooks'
    own (shard()): `load_state_dict()` of every parameter and buffer into a root sharded
    from the meta device is sharc.load_full_state_dict: its buffers, still on
    the meta device, are allocated and loaded too, and the model then has its
    values (forward runs). The entries are replaced by the model's own
    tensors, so torch's copies (or assignments, assign=True) change nothing.
    A load of only some keys is left to torch (it reports the missing ones
    if strict): the parameters it names are loaded, and forward still asks
    for the rest; unexpected keys torch reports as usual."""
    root = state_of(module).root
    if root.pending_init is None or state_of(module).schedule.raw_state_dict:
        return
    own = own_state_dict(module)
    given = {key[len(prefix):]: value for key, value in state_dict.items()
             if key.startswith(prefix)}
    if not set(own) <= set(given):
        return  # torch reports the missing keys (strict) or loads what is given
    given = {key: value for key, value in given.items() if key in own}  # torch reports the rest
    for key, value in given.items():  # torch's copy_ would convert, as here
        if (key in own and isinstance(value, torch.Tensor) and value.dtype != own[key].dtype
                and value.is_floating_point() and own[key].is_floating_point()):
            given[key] = value.to(own[key].dtype)
    load(module, given)
    assign = local_metadata.get("assign_to_params_buffers", False)
    for key, value in own_state_dict(module).items():  # buffers allocated since
        if prefix + key in state_dict:
            state_dict[prefix + key] = value if assign else value.detach()
