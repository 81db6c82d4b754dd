"""sharc.shard() and the per-rank memory figures."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from sharc import _full_param_access, _mesh, _state_dict_hooks, _validate, mixed_precision
from sharc._compile.recompile_room import ROOM as RECOMPILE_ROOM
from sharc._eager_schedule import EagerSchedule, GatherUnit
from sharc._rank_check import RankCheck
from sharc._library import Runtime
from sharc._module_state import ModuleState, state_of
from sharc._param_ref import ShardedParamRef
from sharc._pending_init import AWAITING as AWAITING_INIT, PendingInit, refuse as refuse_unset
from sharc.config import ShardConfig


def _owned_params(module: torch.nn.Module):
    """(submodule, local name, parameter) for every place a parameter is held,
    tied parameters once per owning module."""
    for _, sub in module.named_modules():
        for local, p in sub._parameters.items():
            if p is not None:
                yield sub, local, p


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
    """
    config = config or ShardConfig()
    if not isinstance(config, ShardConfig):
        raise TypeError(f"sharc.shard(): config must be a sharc.ShardConfig, got {config!r}")
    groups = _mesh.resolve(group, mesh, config)
    group = groups.shard
    _validate.check_not_sharded(module)
    meta = _validate.built_on_meta(module)
    if meta:  # only this rank's shards are allocated, there
        device = _validate.shard_device(config.device, group)
    else:
        _validate.check_devices(module, group, config.device)
        device = None
    named = list(module.named_parameters())  # unique parameters, canonical names
    if dist.get_world_size(group) > 1:
        _validate.check_replicas(named, group, config.verify_replicas)
    if groups.replicate is not None and dist.get_world_size(groups.replicate) > 1:
        _validate.check_replicas(named, groups.replicate, config.verify_replicas)

    _validate.check_keep_gathered(config.keep_gathered, named)
    units = _validate.resolve_gather_units(module, config.gather_units)
    dtypes = {p: mixed_precision.param_dtypes(fqn, p, config.mixed_precision) for fqn, p in named}
    runtime = _runtime(group)
    _mesh.attach(runtime, groups.replicate)
    if config.verify_schedule:
        runtime.set_verify_schedule(True)
    refs_by_param = _register(runtime, group.group_name, named, dtypes, device)
    _install_optimizer_check()
    for fqn, p in named:
        if fqn in config.keep_gathered:
            runtime.set_persistent(refs_by_param[p].pid, True)
    unit_ids = {refs_by_param[p].pid for _, unit in units for p in unit.parameters()}
    checks = RankCheck(group, config.rank_check_timeout_s)
    schedule = EagerSchedule(list(refs_by_param.values()), unit_ids, config.eager_prefetch,
                             checks)
    per_module: dict[torch.nn.Module, dict[str, ShardedParamRef]] = {}
    for sub, local, p in _owned_params(module):
        ref = refs_by_param[p]
        sub._parameters[local] = ref.shard
        per_module.setdefault(sub, {})[local] = ref
    per_module.setdefault(module, {})  # the root too: it refuses deepcopy and casts
    root = _ShardedRoot(group, runtime, refs_by_param, checks)
    if meta:
        root.pending_init = PendingInit(module, device,
                                        [(r.fqn, r.shard) for r in refs_by_param.values()])
    for sub, refs in per_module.items():
        state = ModuleState(refs, schedule, root if sub is module else None)
        _full_param_access.install(sub, state)
        _state_dict_hooks.install(sub, state)
        sub.register_forward_pre_hook(schedule.forward_pre_hook)
        sub.register_forward_hook(schedule.forward_hook, always_call=True)
    for _, unit in units:
        _install_unit(unit, runtime, root.refs_by_shard, schedule)
    if config.mixed_precision is not None:
        mixed_precision.install_casts(module, config.mixed_precision)
    RECOMPILE_ROOM.add(module)
    return module


def _install_unit(unit: torch.nn.Module, runtime, refs_by_shard, schedule) -> None:
    refs = [refs_by_shard[id(shard)] for shard in unit.parameters()]  # shards by now, unique
    if not refs:
        return
    for ref in refs:
        runtime.set_deferred_reduction(ref.pid, True)
    gather_unit = GatherUnit(runtime, refs)
    # Registered first, so the unit is gathered before any scope reads it.
    unit.register_forward_pre_hook(lambda *_: schedule.enter_unit(gather_unit), prepend=True)
    unit.register_forward_hook(lambda m, i, out: schedule.exit_unit(gather_unit, out),
                               always_call=True)


_REPLACED = "_sharc_replaced_by_shard"


def _check_optimizer_params(optimizer, *_args, **_kwargs) -> None:
    """Optimizer step pre-hook (every optimizer): an optimizer made before
    shard() holds the unsharded parameters, which never get a gradient again,
    so its steps would silently change nothing."""
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


@functools.cache
def _install_optimizer_check() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_check_optimizer_params)


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
        d = dtypes[p]
        if d.grad != p.dtype:
            shard.grad_dtype = d.grad  # accumulated in the dtype the user asked for
        runtime.set_spec(pid, d.gather, d.reduce, d.grad)
        refs[p] = ShardedParamRef(runtime, group_name, pid, fqn, tuple(p.shape), shard, d.gather)
        setattr(p, _REPLACED, fqn)  # the original no longer trains
    return refs


class _ShardedRoot:
    """What shard() leaves on the root module for the checkpoint helpers.

    It keeps the group's name, not the group: a sharded module must not keep
    a process group alive past destroy_process_group() (the runtime holds it
    weakly too)."""

    def __init__(self, group, runtime, refs_by_param, checks: RankCheck):
        self.group_name = group.group_name
        self.runtime = runtime
        self.checks = checks  # every rank reached a collective call (_rank_check.py)
        self.refs_by_shard = {id(ref.shard): ref for ref in refs_by_param.values()}
        # Built on the meta device and awaiting its values (_pending_init.py).
        self.pending_init: PendingInit | None = None

    def require_values(self, what: str) -> None:
        """Raises, naming `what` and the fix, while the model awaits its values."""
        if self.pending_init is not None:
            refuse_unset(what)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group, while it exists."""
        try:
            return torch._C._distributed_c10d._resolve_process_group(self.group_name)
        except RuntimeError:
            raise RuntimeError(
                f"sharc: the process group '{self.group_name}' this module was sharded on "
                "has been destroyed; build and shard the module again on a live group"
            ) from None


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The sharded module under torch.compile's OptimizedModule wrapper(s)."""
    while hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
        module = module._orig_mod
    return module


def sharded_root(module: torch.nn.Module) -> _ShardedRoot:
    """What shard() left on `module` (or on the module torch.compile wraps)."""
    state = state_of(unwrap_compiled(module))
    root = state.root if state is not None else None
    if root is None:
        raise RuntimeError("this module is not sharded: call sharc.shard(module) first")
    return root


@contextlib.contextmanager
def no_sync(module: torch.nn.Module, enabled: bool = True, *, replicate_only: bool = False):
    """Backward passes inside skip the gradient reduce-scatter: each full
    gradient is summed into a full-size buffer of its parameter's (counted in
    memory_stats()['unreduced_grad_bytes']), and the first backward outside
    reduces the sum once. For gradient accumulation over N micro-batches:
    1/N of the reduce-scatter traffic, for one full-size gradient per
    parameter held between micro-batches. Every rank must use it alike.
    A parameter must get a gradient in the synced backward for what it held
    back to be reduced.

    Hybrid sharding: `no_sync` defers both the reduce-scatter and the
    replicate all-reduce. With `replicate_only=True` only the all-reduce
    over the replicate group (the slow link between hosts) is deferred:
    each micro-batch is reduce-scattered within its shard group and the
    shard gradient sums wait in a shard-sized buffer per parameter
    (memory_stats()['unreplicated_grad_bytes']) until the first backward
    outside all-reduces them once. On flat sharding it defers nothing."""
    if not isinstance(replicate_only, bool):
        raise TypeError(f"sharc.no_sync(): replicate_only must be a bool, got {replicate_only!r}")
    runtime = sharded_root(module).runtime
    setter = runtime.set_replicate_sync if replicate_only else runtime.set_gradient_sync
    if enabled:
        setter(False)
    try:
        yield
    finally:
        if enabled:
            setter(True)


def memory_stats(group=None) -> dict[str, int]:
    """This rank's exact byte figures for `group` (default: the world):
    shard_bytes, gathered_bytes, peak_gathered_bytes, allgather_bytes,
    reduce_scatter_bytes (sent since the last reset), collective counts,
    unreduced_grad_bytes (full gradients held back by no_sync), and the
    collective headers by which the ranks agree on every collective:
    header_bytes (room for them in the gathered buffers, beyond
    gathered_bytes), header_sent_bytes (since the last reset) and
    agreement_calls (collectives beyond the schedule's own it took to agree:
    none once the ranks have run a schedule before, see
    docs/design/collective-agreement.md).

    Hybrid sharding (pass the mesh, or the shard group): the figures above
    are the shard group's (shards over the shard group, reduce-scatter
    bytes sent in it); all_reduce_bytes and all_reduce_calls count the
    replicate group's all-reduces (bytes a ring all-reduce sends from each
    rank: 2 (R-1)/R of the payload, exact for R = 2), all_reduce_header_bytes
    their headers, replicate_size is R, and unreplicated_grad_bytes the shard
    sums held back by no_sync(replicate_only=True)."""
    group = _mesh.shard_group_of(group, "sharc")
    return dict(_runtime(group).stats())


def reset_memory_stats(group=None) -> None:
    """Zeroes the communication counters and resets the peak to the bytes
    gathered now."""
    group = _mesh.shard_group_of(group, "sharc")
    _runtime(group).reset_stats()
