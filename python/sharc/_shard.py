"""sharc.shard(): every parameter registered with the group's runtime and
replaced by its flat shard, each module given its full-parameter access and
state-dict hooks, and the records of _state.py left behind."""

from __future__ import annotations

import collections
import functools
import math
import weakref

import torch
import torch.distributed as dist

from sharc import (_added_after_shard, _decay_groups, _held_gradients, _mesh,
                   _optimizer_support, _optimizer_writes, _parametrize_removal, _shard_mark,
                   _torch_clip, _validate, compute_threads, mixed_precision)
from sharc._compile.recompile_room import ROOM as RECOMPILE_ROOM
from sharc._library import Runtime
from sharc._param_ref import ShardedParamRef
from sharc._pending_init import AWAITING as AWAITING_INIT, PendingInit, refuse as refuse_unset
from sharc._rank_check import RankCheck
from sharc._retired import DEAD_SHARDS
from sharc._state import ModuleState, _ShardedRoot, unwrap_compiled
from sharc.checkpoint import load, state_dict_hooks
from sharc.config import ShardConfig
from sharc.eager import full_param_access
from sharc.eager.schedule import EagerSchedule


def _owned_params(module: torch.nn.Module):
    """(submodule, local name, parameter) for every place a parameter is held,
    tied parameters once per owning module."""
    for _, sub in module.named_modules():
        for local, p in sub._parameters.items():
            if p is not None:
                yield sub, local, p


def _tied(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters installed in more than one place (a tied embedding
    and output head)."""
    places = collections.Counter(p for _, _, p in _owned_params(module))
    return [p for p, n in places.items() if n > 1]


def _owners(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id of each parameter -> the first module holding it (the one whose
    canonical name named_parameters() gives it)."""
    owners: dict[int, torch.nn.Module] = {}
    for sub, _, p in _owned_params(module):
        owners.setdefault(id(p), sub)
    return owners


def _runtime(group) -> Runtime:
    return Runtime.for_group(group.group_name)


def shard(module: torch.nn.Module, group=None, *, config: ShardConfig | None = None,
          mesh=None):
    """Shards `module`'s parameters over `group` (default: the world), in place.

    Hybrid sharding: `mesh`, a 2-D DeviceMesh with dims ("replicate",
    "shard") (or `config.replicate_groups`), shards over the mesh's shard
    dimension and replicates over the other: gradients are reduce-scattered
    in the shard group, then all-reduced over the replicate group, averaged
    over every rank as flat sharding does (docs/design/hybrid-sharding.md).

    Afterwards `module.parameters()` yields each rank's flat, padded shard, so
    any optimizer updates sharded state; forward code is unchanged, each
    parameter read yielding the gathered full tensor. Tied parameters stay
    tied, frozen parameters are sharded and never reduced, buffers stay
    replicated. Collective: every rank of the group must call it.

    A model built on the meta device (`with torch.device("meta"):`) gets
    only this rank's shards, allocated on `config.device`; it then awaits
    its values from sharc.init_weights() or sharc.load_full_state_dict()
    (docs/design/meta-init.md).

    Given what torch.compile returned, shards the model under it: the
    wrapper and the model both work afterwards, and `module` is returned.
    """
    # Every helper (full_state_dict, unsharded, ...) finds the root on the
    # model under the wrapper, so the records go there.
    _shard_in_place(unwrap_compiled(module), group, config, mesh)
    return module


def _shard_in_place(module: torch.nn.Module, group, config: ShardConfig | None, mesh) -> None:
    """shard() of a module that is not a torch.compile wrapper."""
    config = config or ShardConfig()
    if not isinstance(config, ShardConfig):
        raise TypeError(f"sharc.shard(): config must be a sharc.ShardConfig, got {config!r}")
    DEAD_SHARDS.retire()  # a model deleted before this one: its bytes first
    groups = _mesh.resolve(group, mesh, config)
    group = groups.shard
    _validate.check_not_sharded(module)
    if _validate.group_device(group).type == "cpu":  # gloo: before its first copy
        compute_threads.keep_for_this_thread()  # [Note: one thread for gloo's threads]
    meta = _validate.built_on_meta(module)
    if meta:  # only this rank's shards are allocated, there
        device = _validate.shard_device(config.device, group)
    else:
        _validate.check_devices(module, group, config.device)
        device = None
    named = list(module.named_parameters())  # unique parameters, canonical names
    _validate.check_param_dtypes(named)
    _validate.check_no_tensor_hooks(named)
    _validate.check_no_kept_references(module, named)
    if dist.get_world_size(group) > 1:
        _validate.check_replicas(named, group, config.verify_replicas)
    if groups.replicate is not None and dist.get_world_size(groups.replicate) > 1:
        _validate.check_replicas(named, groups.replicate, config.verify_replicas)

    kept = _validate.resolve_keep_gathered(config.keep_gathered, named)
    units = _validate.resolve_gather_units(module, config.gather_units)
    owners = _owners(module)
    dtypes = {p: mixed_precision.param_dtypes(fqn, p, owners[id(p)], config.mixed_precision)
              for fqn, p in named}
    runtime = _runtime(group)
    _mesh.attach(runtime, groups.replicate)
    if config.verify_schedule:
        runtime.set_verify_schedule(True)
    refs_by_param = _register(runtime, group.group_name, named, dtypes, device)
    _install_optimizer_check()
    _optimizer_writes.install()  # [Note: shard writes a version counter misses]
    _held_gradients.install()  # [Note: gradients held by no_sync]
    _torch_clip.install()  # [Note: torch's clipping on shards]
    _parametrize_removal.install()  # [Note: removing a parametrization after shard]
    for fqn, p in named:
        if fqn in kept:
            runtime.set_persistent(refs_by_param[p].pid, True)
    unit_ids = {refs_by_param[p].pid for _, unit in units for p in unit.parameters()}
    checks = RankCheck(group, config.rank_check_timeout_s)
    tied_ids = {refs_by_param[p].pid for p in _tied(module)} - unit_ids
    schedule = EagerSchedule(list(refs_by_param.values()), unit_ids, config.eager_prefetch,
                             checks, config.eager_reduce_bucket_bytes, tied_ids)
    per_module: dict[torch.nn.Module, dict[str, ShardedParamRef]] = {}
    for sub, local, p in _owned_params(module):
        ref = refs_by_param[p]
        sub._parameters[local] = ref.shard
        per_module.setdefault(sub, {})[local] = ref
    per_module.setdefault(module, {})  # the root too: it refuses deepcopy and casts
    root = _ShardedRoot(group, runtime, refs_by_param, checks)
    if meta:
        root.pending_init = PendingInit(
            module, device, [(r.fqn, r.shard) for r in refs_by_param.values()],
            {r.pid: p._version for p, r in refs_by_param.items() if p._version > 0})
    for sub, refs in per_module.items():
        state = ModuleState(refs, schedule, root if sub is module else None)
        full_param_access.install(sub, state)
        if sub is module:  # before state_dict_hooks' own: a meta-built root loads whole
            sub.register_load_state_dict_pre_hook(load.values_for_meta_built)
        state_dict_hooks.install(sub, state)
        sub.register_forward_pre_hook(schedule.forward_pre_hook)
        sub.register_forward_hook(schedule.forward_hook, always_call=True)
    for _, unit in units:
        _install_unit(unit, root.refs_by_shard, schedule, config.unit_keep_bytes)
    if config.mixed_precision is not None:
        mixed_precision.install_casts(module, config.mixed_precision)
    _added_after_shard.mark(module)
    _added_after_shard.install()  # [Note: added after shard]
    RECOMPILE_ROOM.add(module)


def _install_unit(unit: torch.nn.Module, refs_by_shard, schedule, keep_bytes: int) -> None:
    refs = [refs_by_shard[id(shard)] for shard in unit.parameters()]  # shards by now, unique
    if not refs:
        return
    for ref in refs:
        ref.runtime.set_deferred_reduction(ref.pid, True)
    gathered = sum(math.prod(ref.shape) * ref.gather_dtype.itemsize for ref in refs)
    index = schedule.add_unit(refs, keep=gathered <= keep_bytes)
    # Registered first, so the unit is gathered before any scope reads it.
    unit.register_forward_pre_hook(lambda *_: schedule.enter_unit(index), prepend=True)
    unit.register_forward_hook(lambda m, i, out: schedule.exit_unit(index, out),
                               always_call=True)


_REPLACED = "_sharc_replaced_by_shard"


def _check_optimizer_params(optimizer, *_args, **_kwargs) -> None:
    """Optimizer step pre-hook (every optimizer): an optimizer made before
    shard() holds the unsharded parameters, which never get a gradient again,
    so its steps would silently change nothing; and an optimizer that computes
    over whole parameters cannot train flat shards ([Note: optimizers over
    whole parameters] in _optimizer_support.py)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, _REPLACED, None)
            if name is not None and p.is_meta:
                raise RuntimeError(
                    f"sharc: this {type(optimizer).__name__} holds the meta-device parameter "
                    f"'{name}': it was created from a model built on the meta device, before "
                    "sharc.shard(). Create the optimizer after shard(), from "
                    "model.parameters() (the shards)")
            name = getattr(p, AWAITING_INIT, None)
            if name is not None:
                refuse_unset(f"an optimizer step over the shard of '{name}' ran")
            name = getattr(p, _REPLACED, None)
            if name is not None:
                raise RuntimeError(
                    f"sharc: this {type(optimizer).__name__} was created before "
                    f"sharc.shard() and still holds the unsharded parameter '{name}', which "
                    "no longer trains; create the optimizer after shard() from "
                    "model.parameters() (the shards)")
    _optimizer_support.check_step(optimizer)
    _decay_groups.check(optimizer)  # [Note: decay groups by dimension]
    _held_gradients.refuse_step_over_held(optimizer)  # [Note: gradients held by no_sync]


@functools.cache
def _install_optimizer_check() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_check_optimizer_params)
    _optimizer_support.install()


def _register(runtime, group_name: str, named, dtypes,
              device: torch.device | None) -> dict[torch.nn.Parameter, ShardedParamRef]:
    """Registers every parameter: from its value, or, for a model built on the
    meta device (`device` given), from its shape and dtype only."""
    refs = {}
    for fqn, p in named:
        if device is None:
            pid = runtime.register_param(p.detach(), fqn)
        else:
            pid = runtime.register_empty(list(p.shape), p.dtype, device, fqn)
        shard = torch.nn.Parameter(runtime.shard(pid), requires_grad=p.requires_grad)
        runtime.set_parameter(pid, shard)
        # When the parameter dies (model and optimizer deleted), the runtime
        # gives its bytes back ([Note: retired parameters]); not at exit.
        weakref.finalize(shard, DEAD_SHARDS.note, runtime, pid).atexit = False
        # What code set on the parameter (Mamba's `_no_weight_decay`, tags
        # that build optimizer groups) goes on with it: optimizers are built
        # from the shards.
        vars(shard).update(vars(p))
        _shard_mark.mark_shard(shard, group_name)
        _optimizer_writes.mark_shard(shard, pid)
        _decay_groups.mark_shard(shard, tuple(p.shape), fqn)
        d = dtypes[p]
        if d.grad != p.dtype:
            shard.grad_dtype = d.grad  # accumulated in the dtype the user asked for
        runtime.set_spec(pid, d.gather, d.reduce, d.grad)
        refs[p] = ShardedParamRef(runtime, group_name, pid, fqn, tuple(p.shape), shard, d.gather)
        setattr(p, _REPLACED, fqn)  # the original no longer trains
    return refs
