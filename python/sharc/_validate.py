"""Checks that shard() runs before it changes anything, each failing with a
message that says what is wrong and how to fix it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharc._fingerprint import fingerprint
from sharc._state import state_of

# Device types each c10d backend can communicate.
# Gloo runs every collective sharc issues on CUDA tensors too (ranks sharing
# one GPU: tests/python/test_cuda.py, run on an H200).
_BACKEND_DEVICES = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}, "mpi": {"cpu", "cuda"}}


def check_group(group, who: str = "sharc") -> dist.ProcessGroup:
    """The group to use (default: the world), once torch.distributed is set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first, or start the ranks with "
            "sharc.launch.launch(), `python -m sharc.train` or torchrun")
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group(ranks) returns on the ranks it leaves out: a
        # caller that passes it on means this rank should not be here.
        raise ValueError(
            f"{who}: this rank (global rank {dist.get_rank()}) is not in the group: "
            "torch.distributed.new_group(ranks) returns GroupMember.NON_GROUP_MEMBER on "
            "every rank outside `ranks`. Make this call only on the group's ranks (the "
            "other ranks need not call it and are not waited for)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: group must be a torch.distributed.ProcessGroup (or None for "
                        f"the default group), got {type(group).__name__}")
    return group if group is not None else dist.group.WORLD


def group_device(group) -> torch.device:
    """A device the group's backend communicates: the CPU if it can."""
    if "cpu" in _backend_devices(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_not_sharded(module: torch.nn.Module) -> None:
    sharded_here = any(state_of(sub) is not None and state_of(sub).root is not None
                       for sub in module.modules())
    for name, sub in module.named_modules():
        if state_of(sub) is not None and not sharded_here:
            # No root of a sharded model in this tree: `sub` is shared with
            # a model sharded before (a common encoder of two models), whose
            # shards and runtime records it belongs to.
            raise RuntimeError(
                f"sharc.shard(): this module's submodule '{name}' is part of another model "
                "sharded before (a submodule shared between two models); a module's "
                "parameters are sharded with one model only. Shard one root that holds both "
                "models instead (e.g. sharc.shard(torch.nn.ModuleDict({'a': model_a, "
                "'b': model_b})), before either is sharded)")
        if state_of(sub) is not None:
            where = f"its submodule '{name}'" if name else "it"
            nested = (" sharc gathers and releases per submodule by itself, so there is no "
                      "per-layer wrapping as with FSDP: call sharc.shard() on the root "
                      "module only.") if name else ""
            raise RuntimeError(
                f"sharc.shard() was already called on this module ({where} is sharded); "
                f"shard a module once, before creating its optimizer.{nested}")


def _backend_devices(group) -> set[str]:
    backend = str(dist.get_backend(group)).lower()
    devices: set[str] = set()
    for part in backend.split(","):  # "cpu:gloo,cuda:nccl" or "gloo"
        if ":" in part:
            device, name = part.split(":", 1)
            if name in _BACKEND_DEVICES:
                devices.add(device)
        else:
            devices |= _BACKEND_DEVICES.get(part, {"cpu", "cuda"})
    return devices


def built_on_meta(module: torch.nn.Module) -> bool:
    """Whether every parameter is on the meta device (a model to initialise
    into shards, see materialize.py); a model with some parameters on meta
    and others not is refused."""
    named = list(module.named_parameters())
    on_meta = [name for name, p in named if p.is_meta]
    if on_meta and len(on_meta) < len(named):
        real = next(name for name, p in named if not p.is_meta)
        raise RuntimeError(
            f"parameter '{on_meta[0]}' is on the meta device but '{real}' is not: sharc "
            "shards a model built wholly on the meta device (`with torch.device('meta'):`, "
            "then sharc.init_weights or sharc.load_full_state_dict) or wholly on a real one")
    return bool(on_meta)


def shard_device(wanted: torch.device | None, group) -> torch.device:
    """Where a meta-built model's shards go: `wanted`, else the group's device."""
    device = wanted if wanted is not None else group_device(group)
    supported = _backend_devices(group)
    if device.type not in supported:
        raise RuntimeError(
            f"ShardConfig.device is '{device}', but the process group's backend "
            f"'{dist.get_backend(group)}' communicates only {sorted(supported)} tensors: name "
            "a matching device or leave it None")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_devices(module: torch.nn.Module, group, wanted: torch.device | None = None) -> None:
    supported = _backend_devices(group)
    for name, p in module.named_parameters():
        if wanted is not None and p.device != wanted:
            raise ValueError(
                f"ShardConfig.device is '{wanted}' but parameter '{name}' is on '{p.device}': "
                "ShardConfig.device places the shards of a model built on the meta device; "
                "move a real model with model.to(device) before shard() instead")
        if p.device.type not in supported:
            raise RuntimeError(
                f"parameter '{name}' is on device '{p.device}', but the process group's "
                f"backend '{dist.get_backend(group)}' communicates only {sorted(supported)} "
                "tensors: move the module to a matching device (e.g. .cpu() for gloo, "
                ".cuda() for nccl) or use a group with a matching backend")


def check_param_dtypes(named_params) -> None:
    """Complex parameters are refused up front: the runtime calls the
    backends' collectives directly, and neither gloo nor NCCL has a complex
    type, so they would otherwise fail at the first forward with a bare
    "Invalid scalar type"."""
    for fqn, p in named_params:
        if p.is_complex():
            raise TypeError(
                f"sharc.shard(): parameter '{fqn}' is complex ({p.dtype}), which sharc does not "
                "shard. Store it as a real parameter with a trailing dimension of 2 "
                "(nn.Parameter(torch.view_as_real(value))) and read it with "
                "torch.view_as_complex(self.<name>) in forward")


def check_no_tensor_hooks(named_params) -> None:
    """Gradient hooks on a parameter (`register_hook`,
    `register_post_accumulate_grad_hook`) belong to that Parameter object,
    which shard() replaces by its flat shard: they would silently never run
    again. Refused, so the user registers them on the shards instead."""
    for fqn, p in named_params:
        kinds = [how for how, hooks in (("register_hook", p._backward_hooks),
                                         ("register_post_accumulate_grad_hook",
                                          p._post_accumulate_grad_hooks)) if hooks]
        if kinds:
            raise RuntimeError(
                f"sharc: parameter '{fqn}' has gradient hooks ({' and '.join(kinds)}), "
                "registered before sharc.shard(); shard() replaces every parameter with its "
                "flat shard, so they would never be called. Register them on the shards after "
                "shard(): `for name, p in model.named_parameters(): p.register_hook(...)` (a "
                "hook there sees this rank's flat shard of the averaged gradient, not the "
                "full gradient)")


# torch's own entries in every module's __dict__ (hooks, flags, the
# registries): none holds a reference the user made.
_MODULE_BOOKKEEPING = frozenset(vars(torch.nn.Module()))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_CONTAINER_DEPTH = 4  # [Note: a parameter kept apart from its module]


def check_no_kept_references(module: torch.nn.Module, named_params) -> None:
    """[Note: a parameter kept apart from its module]
    shard() swaps each parameter for its shard in the module that registers
    it, the only place it knows of. A reference kept elsewhere in a plain
    container (`self.ext = [self.a.weight]`, DeepSpeed's "external
    parameter" pattern) would still be the original full Parameter
    afterwards: forward would read and train it apart on each rank, its
    gradient never reduced nor stepped, silently. So shard() looks through
    every module attribute that is a list, tuple, dict or set (nested ones
    too, a few levels deep: deeper structures are rare and the walk must
    stay cheap on large attributes) and refuses one holding a parameter it
    shards. A reference to the module (`self.ext = [self.a]`) reads
    `self.ext[0].weight` through sharc and is fine. Lists sharc keeps in
    step itself (a recurrent layer's `_flat_weights`, see
    full_param_access.kept_in_step_by_sharc) are left alone."""
    from sharc.eager.full_param_access import kept_in_step_by_sharc

    sharded = {id(p): fqn for fqn, p in named_params}
    for path, sub in module.named_modules():
        for attribute, value in vars(sub).items():
            if attribute in _MODULE_BOOKKEEPING or kept_in_step_by_sharc(sub, attribute):
                continue
            fqn = _parameter_in(value, sharded, _CONTAINER_DEPTH)
            if fqn is not None:
                _refuse_kept_reference(path, sub, attribute, value, fqn)


def _parameter_in(value, sharded: dict[int, str], depth: int) -> str | None:
    """The name of a sharded parameter `value` is or holds within `depth`
    levels of containers (dicts: keys and values), else None."""
    if isinstance(value, torch.nn.Parameter):
        return sharded.get(id(value))
    if depth == 0 or not isinstance(value, _CONTAINERS):
        return None
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    for item in items:
        fqn = _parameter_in(item, sharded, depth - 1)
        if fqn is not None:
            return fqn
    return None


def _refuse_kept_reference(path: str, sub, attribute: str, value, fqn: str) -> None:
    where = f"module '{path}' ({type(sub).__name__})" if path else \
        f"the root module ({type(sub).__name__})"
    raise RuntimeError(
        f"sharc: {where} keeps the parameter '{fqn}' in its attribute '{attribute}' (a "
        f"{type(value).__name__}), apart from the module that registers it. shard() replaces "
        "each parameter with its flat shard in its module only, so this reference would stay "
        "the original full parameter, and forward would read and train it apart on each rank "
        "(its gradient never reduced nor stepped). Keep a reference to the module instead "
        "(e.g. `[self.a]` rather than `[self.a.weight]`) and read the parameter through it "
        "in forward (`self.ext[0].weight`)")


def _signature(named_params, checksum: bool) -> list[tuple]:
    sig = []
    for fqn, p in named_params:
        value = fingerprint(p) if checksum and not p.is_meta else ""  # meta: no values yet
        sig.append((fqn, tuple(p.shape), str(p.dtype), value))
    return sig


def check_replicas(named_params: list[tuple[str, torch.Tensor]], group,
                   check_values: bool) -> None:
    """One collective: every rank must hold the same parameters."""
    world = dist.get_world_size(group)
    sigs: list = [None] * world
    dist.all_gather_object(sigs, _signature(named_params, check_values), group=group)
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        if len(sig) != len(ref):
            raise RuntimeError(
                f"ranks hold different models: rank 0 has {len(ref)} parameters, rank "
                f"{rank} has {len(sig)}; build the same model on every rank before shard()")
        for (n0, s0, d0, v0), (n1, s1, d1, v1) in zip(ref, sig):
            _compare(rank, n0, s0, d0, v0, n1, s1, d1, v1)


def _compare(rank, n0, s0, d0, v0, n1, s1, d1, v1) -> None:
    if n0 != n1:
        raise RuntimeError(f"ranks hold different models: parameter '{n0}' on rank 0 "
                           f"is '{n1}' on rank {rank}; build the same model on every rank")
    if s0 != s1:
        raise RuntimeError(f"parameter '{n0}' has shape {s0} on rank 0 but {s1} on rank "
                           f"{rank}; build the same model on every rank")
    if d0 != d1:
        raise RuntimeError(f"parameter '{n0}' has dtype {d0} on rank 0 but {d1} on rank "
                           f"{rank}; build the same model on every rank")
    if v0 != v1:
        raise RuntimeError(
            f"parameter '{n0}' has different values on rank 0 and rank {rank}: seed every "
            "rank identically before building the model (or load a checkpoint after "
            "shard()), or pass ShardConfig(verify_replicas=False) if this is intended")


def resolve_keep_gathered(patterns: tuple[str, ...], named) -> set[str]:
    """The parameter names ShardConfig.keep_gathered's names or shell-style
    patterns match, as gather_units' patterns match modules; each must
    match one or more."""
    import fnmatch

    known = [fqn for fqn, _ in named]
    kept = set()
    for pattern in patterns:
        hits = [fqn for fqn in known if fnmatch.fnmatchcase(fqn, pattern)]
        if not hits:
            raise ValueError(f"ShardConfig.keep_gathered names {pattern!r}, which is not a "
                             "parameter of this module and matches none; use a name (or a "
                             "shell-style pattern) from module.named_parameters(), e.g. "
                             + repr(sorted(known)[:3]))
        kept.update(hits)
    return kept


def resolve_gather_units(module: torch.nn.Module, patterns: tuple[str, ...]):
    """(name, submodule) for every module a ShardConfig.gather_units pattern
    names; each pattern must match modules that are called, and no unit may
    sit inside another."""
    import fnmatch

    named = list(module.named_modules())
    units = []
    for pattern in patterns:
        hits = _outermost([(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)])
        if not hits:
            raise ValueError(f"ShardConfig.gather_units names {pattern!r}, which matches no "
                             "module; use names from module.named_modules(), e.g. "
                             + repr([n for n, _ in named if n][:3]))
        for name, sub in hits:
            _check_called(pattern, name, sub, named)
        units += [h for h in hits if h not in units]
    for outer, _ in units:
        for inner, _ in units:
            if inner != outer and inner.startswith(outer + ".") or (outer == "" and inner):
                raise ValueError(f"ShardConfig.gather_units: unit '{inner}' lies inside unit "
                                 f"'{outer}'; name only the outer one")
    return units


def _outermost(hits):
    """The matches of one pattern that lie inside no other match of it: `*`
    also matches dots, so "blocks.*" matches each block and every module
    inside it, and the user means the blocks."""
    names = [n for n, _ in hits]
    return [(n, m) for n, m in hits
            if not any(o != n and (o == "" or n.startswith(o + ".")) for o in names)]


def _never_called(module: torch.nn.Module) -> bool:
    """A module without a forward of its own (ModuleList, ModuleDict,
    ParameterList, ...): calling it raises, so its forward hooks never run."""
    return "forward" not in module.__dict__ and type(module).forward is torch.nn.Module.forward


def _check_called(pattern: str, name: str, module: torch.nn.Module, named) -> None:
    """A unit is gathered by hooks on its forward: one that is never called
    (a container whose entries are used one by one) would gather nothing,
    and the ranks' divergent uses of its entries would still mismatch."""
    if not _never_called(module):
        return
    modules = dict(named)
    caller = name
    while caller and _never_called(modules[caller]):
        caller = caller.rpartition(".")[0]
    instead = f"'{caller}'" if caller else "the root module ('')"
    matched = "" if pattern == name else f" (matched by {pattern!r})"
    raise ValueError(
        f"ShardConfig.gather_units names '{name}'{matched}, a {type(module).__name__}: it has "
        "no forward and is never called, so its unit, gathered when its forward starts, "
        "would never be, and ranks whose data uses different entries of it would still "
        f"issue different collectives. Name the module whose forward uses it instead: "
        f"{instead}")
