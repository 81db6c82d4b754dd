"""Sharded state dicts for torch.distributed.checkpoint (DCP).

    model_sd, optim_sd = sharc.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ...
    dcp.load(state, checkpoint_id=path)   # state from get_state_dict on the new job
    sharc.set_state_dict(model, optimizer, model_state_dict=state["model"],
                         optim_state_dict=state["optim"])

Keys, nesting and global shapes are those of
torch.distributed.checkpoint.state_dict.get_state_dict for the same model
unsharded (original parameter names, optimizer state under "state.<fqn>",
param_groups listing fqns), so a checkpoint moves between sharc on any number
of ranks and plain PyTorch. Each rank contributes only what it owns: its
parameter and optimizer-state shards as ShardedTensors whose local shards
view the real shard storage (sharded_view.py). See docs/design/checkpoints.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from sharc import _rank_check
from sharc._gather_flat import gather_full
from sharc._state import sharded_root, state_of, unwrap_compiled
from sharc.checkpoint.sharded_view import copy_into_flat, scalar_view, sharded_view
from sharc.checkpoint.state_dict_hooks import own_state_dict


def _clean(name: str) -> str:
    return name.replace("_orig_mod.", "")  # compiled submodules add this prefix


class _Exporter:
    """Turns shard-laid-out tensors into checkpoint values. 0-dim parameters
    (and their optimizer state) live on rank 0 only, so their values are
    sent to the other ranks once, in one broadcast per dtype, by finish()."""

    def __init__(self, group):
        self.group = group
        self.scalars: list[tuple[torch.Tensor, bool]] = []

    def replicated(self, value):
        """A value every rank holds alike (a buffer, AdamW's step): itself,
        as DCP loads into it in place."""
        return value

    def value(self, flat: torch.Tensor, shape: tuple[int, ...]):
        if shape:
            return sharded_view(flat, shape, self.group)
        scalar, needs_fill = scalar_view(flat, self.group)
        self.scalars.append((scalar, needs_fill))
        return scalar

    def finish(self) -> None:
        if dist.get_world_size(self.group) == 1:
            return
        for dtype in sorted({s.dtype for s, _ in self.scalars}, key=str):
            mine = [(s, fill) for s, fill in self.scalars if s.dtype == dtype]
            buf = torch.stack([s for s, _ in mine])
            dist.broadcast(buf, group=self.group, group_src=0)
            for (s, fill), v in zip(mine, buf):
                if fill:
                    s.copy_(v)


class _FullExporter:
    """Gathers shard-laid-out tensors to their full shape instead (every rank
    takes part in each gather), kept where `keeps`, on the CPU with
    `cpu_offload`."""

    def __init__(self, group, keeps: bool, cpu_offload: bool):
        self.group, self.keeps, self.cpu_offload = group, keeps, cpu_offload

    def replicated(self, value):
        """A copy (the dict is a snapshot, not the live state), or None where
        nothing is kept."""
        if not self.keeps:
            return None
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().to("cpu", copy=True) if self.cpu_offload else value.detach().clone()

    def value(self, flat: torch.Tensor, shape: tuple[int, ...]):
        full = gather_full(flat, shape, self.group)
        if not self.keeps:
            return None
        return full.cpu() if self.cpu_offload else full

    def finish(self) -> None:
        """Nothing is left to send: 0-dim values were gathered too."""


def get_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   full: bool = False, rank0_only: bool = False, cpu_offload: bool = False):
    """(model_state_dict, optim_state_dict) of a sharded model, ready for
    `dcp.save` and, built on a new job, as the target of `dcp.load`.

    Parameters (and optimizer tensors shaped like a parameter's shard) are
    ShardedTensors of the original shape that alias this rank's shards;
    buffers and scalar optimizer state (AdamW's step) are replicated tensors.
    With `optimizer=None` the second element is an empty dict. An optimizer
    that has not stepped yet gets its state created by one step with lr 0
    (what torch's get_state_dict does too), so that a load has targets.
    Collective: call it on every rank (the ranks check that they all did,
    with the same options; 0-dim parameters add one small broadcast). Not
    inside sharc.unsharded(). The model may be the module torch.compile
    returned.

    With `full=True` every parameter and every shard-shaped optimizer tensor
    is gathered to its full shape instead (plain tensors, the same keys):
    what torch's get_state_dict gives for the model unsharded, loadable into
    one (`torch.distributed.checkpoint.state_dict.set_state_dict`) or back
    into sharc (`set_state_dict` takes full tensors). Collective (every
    rank must pass the same `full` and `rank0_only`: checked). With
    `rank0_only=True` only rank 0 of the model's group keeps them (the
    others get `({}, {})` and hold one gathered tensor at a time); with
    `cpu_offload=True` each gathered tensor is moved to the CPU.
    """
    for name, flag in (("full", full), ("rank0_only", rank0_only), ("cpu_offload", cpu_offload)):
        if not isinstance(flag, bool):
            raise TypeError(f"sharc.get_state_dict: {name} must be a bool, got {flag!r}")
    if (rank0_only or cpu_offload) and not full:
        raise ValueError("sharc.get_state_dict: rank0_only and cpu_offload apply to full=True "
                         "(a sharded state dict is each rank's own shards)")
    model = unwrap_compiled(model)
    root = sharded_root(model)
    # A sharded checkpoint loads into a model that has values (its buffers
    # and optimizer state exist): give a meta-built one values first.
    root.require_values("sharc.get_state_dict (a checkpoint save or load) was called")
    # On a device the last collectives of a step may still be unsettled (their
    # headers on their way to the host): a divergence raises before a save.
    root.runtime.settle_all()
    if state_of(model).schedule.unsharded is not None:
        raise RuntimeError("sharc.get_state_dict: called inside sharc.unsharded(), where the "
                           "shards stand for full tensors; call it after the `with` block "
                           "(sharc.full_state_dict(model) inside it gives the full tensors)")
    # Every rank must choose alike: a full state dict gathers, a sharded one
    # does not, and a rank waiting in a gather would hang.
    root.checks.agree(_rank_check.GET_STATE_DICT, value=2 * int(full) + int(rank0_only))
    if full:
        keeps = not rank0_only or dist.get_rank(root.group) == 0
        export = _FullExporter(root.group, keeps, cpu_offload)
    else:
        keeps = True
        export = _Exporter(root.group)
    views: dict[int, object] = {}  # one value per shard, shared by tied names
    model_sd = {}
    for name, value in own_state_dict(model).items():
        ref = root.refs_by_shard.get(id(value))
        if ref is None:
            if keeps:
                model_sd[_clean(name)] = export.replicated(value.detach())
            continue
        if ref.pid not in views:
            views[ref.pid] = export.value(ref.shard, ref.shape)
        model_sd[_clean(name)] = views[ref.pid]
    optim_sd = {} if optimizer is None else _optim_state_dict(optimizer, root, export)
    export.finish()
    return (model_sd, optim_sd) if keeps else ({}, {})


def _ref_of(root, p, where: str):
    ref = root.refs_by_shard.get(id(p))
    if ref is None:
        raise ValueError(f"{where}: the optimizer holds a parameter of shape {tuple(p.shape)} "
                         "that is not a shard of this sharded model; build the optimizer "
                         "from model.parameters() after sharc.shard(model)")
    return ref


def _optim_state_dict(optimizer, root, export: _Exporter) -> dict:
    if not optimizer.state:
        _init_optimizer_state(optimizer)
    state, groups = {}, []
    for group in optimizer.param_groups:
        fqns = []
        for p in group["params"]:
            ref = _ref_of(root, p, "sharc.get_state_dict")
            fqns.append(ref.fqn)
            if optimizer.state.get(p):
                state[ref.fqn] = {k: _export_state(v, ref, k, export)
                                  for k, v in optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def _is_sharded_state(value, ref) -> bool:
    """Optimizer state laid out like the shard (exp_avg, momentum, ...), as
    opposed to a replicated scalar (step)."""
    return (isinstance(value, torch.Tensor) and value.dim() == 1
            and value.shape == ref.shard.shape)


def _export_state(value, ref, key: str, export: _Exporter):
    if _is_sharded_state(value, ref):
        return export.value(value, ref.shape)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return export.replicated(value)  # identical on every rank
    raise ValueError(f"sharc.get_state_dict: optimizer state '{key}' of '{ref.fqn}' has shape "
                     f"{tuple(value.shape)}; sharc checkpoints hold state shaped like the "
                     f"parameter's shard {tuple(ref.shard.shape)} or 0-dim scalars")


def _init_optimizer_state(optimizer) -> None:
    """One step with lr 0 and zero gradients creates every state tensor and
    leaves parameters bitwise unchanged (the update is scaled by lr)."""
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    filled = []
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                filled.append(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr):
            g["lr"] = lr
        for p in filled:
            p.grad = None


def set_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_state_dict: dict, optim_state_dict: dict | None = None) -> None:
    """Loads what `get_state_dict` produced (after `dcp.load` filled it) into
    the sharded model and, if given, the optimizer. Sharded entries may also
    be full tensors of the original shape (this rank's slice is taken), so an
    unsharded state dict loads too. Checks every model key and shape, and the
    optimizer's parameter groups, first, and raises naming the first mismatch
    before changing anything. Not collective.
    """
    model = unwrap_compiled(model)
    root = sharded_root(model)
    own = {_clean(k): v for k, v in own_state_dict(model).items()}
    _check_model_keys(own, model_state_dict, root)
    if optimizer is not None:
        if optim_state_dict is None:
            raise ValueError("sharc.set_state_dict: an optimizer was given without "
                             "optim_state_dict; pass both, or optimizer=None for model only")
        by_fqn = _check_optim(optimizer, root, optim_state_dict)
    with torch.no_grad():
        for name, target in own.items():
            value = model_state_dict[name]
            ref = root.refs_by_shard.get(id(target))
            if ref is not None:
                copy_into_flat(value, ref.shard.detach(), ref.shape, root.group)
            elif value is not target:
                target.copy_(value)
    if optimizer is not None:
        fresh = not optimizer.state
        if fresh:
            # Its state made first (lr 0), so that each loaded value finds
            # the layout it takes: a 0-dim parameter's full exp_avg and a
            # replicated step are both 0-dim tensors, and only the current
            # state tells which becomes a [1] shard.
            _init_optimizer_state(optimizer)
        _load_optim(optimizer, by_fqn, optim_state_dict, root.group)
        if fresh:  # a parameter with no saved state has none, as before the load
            for fqn, ref in by_fqn.items():
                if fqn not in optim_state_dict["state"]:
                    optimizer.state.pop(ref.shard, None)


def _check_model_keys(own: dict, given: dict, root) -> None:
    for name in own:
        if name not in given:
            raise KeyError(f"sharc.set_state_dict: key '{name}' of the model is missing from "
                           "the state dict; it was saved from a different model")
    for name in given:
        if name not in own:
            raise KeyError(f"sharc.set_state_dict: the state dict has key '{name}', which the "
                           "model does not; it was saved from a different model")
    for name, target in own.items():
        ref = root.refs_by_shard.get(id(target))
        want = ref.shape if ref is not None else tuple(target.shape)
        got = tuple(given[name].size())
        if got != want:
            raise ValueError(f"sharc.set_state_dict: '{name}' has shape {got} in the state "
                             f"dict but {want} in the model; it was saved from a different "
                             "model architecture")


def _check_optim(optimizer, root, osd: dict) -> dict:
    """The saved groups list the same parameters as the optimizer's, and the
    saved state names only those; returns fqn -> ShardedParamRef."""
    refs = [[_ref_of(root, p, "sharc.set_state_dict") for p in group["params"]]
            for group in optimizer.param_groups]
    check_param_groups([list(g["params"]) for g in osd["param_groups"]],
                       [[ref.fqn for ref in group] for group in refs],
                       "sharc.set_state_dict: the state dict")
    by_fqn = {ref.fqn: ref for group in refs for ref in group}
    for fqn in osd["state"]:
        if fqn not in by_fqn:
            raise KeyError(f"sharc.set_state_dict: optimizer state for '{fqn}', which no "
                           "param group holds")
    return by_fqn


def check_param_groups(saved: list[list[str]], mine: list[list[str]], source: str) -> None:
    """Raises unless `saved` (each param group's parameter names, in a state
    dict or a checkpoint named by `source`) lists the optimizer's `mine`:
    as many groups, the same parameters in the same order (state is matched
    by position)."""
    fix = ("build the optimizer's param groups as in the saved job (the same parameters, "
           "grouped and ordered alike)")
    if len(saved) != len(mine):
        raise ValueError(f"{source} does not fit this optimizer: it holds {len(saved)} param "
                         f"groups, the optimizer {len(mine)}; {fix}")
    for i, (saved_names, my_names) in enumerate(zip(saved, mine)):
        if saved_names != my_names:
            first = next((j for j, (a, b) in enumerate(zip(saved_names, my_names)) if a != b),
                         min(len(saved_names), len(my_names)))
            raise ValueError(
                f"{source} does not fit this optimizer: its param group {i} holds "
                f"{len(saved_names)} parameters, the optimizer's {len(my_names)}, first "
                f"differing at position {first} ({_name_at(saved_names, first)} saved, "
                f"{_name_at(my_names, first)} here); {fix}")


def _name_at(names: list, i: int) -> str:
    return repr(names[i]) if i < len(names) else "nothing"


def _load_optim(optimizer, by_fqn: dict, osd: dict, group) -> None:
    for fqn, saved_state in osd["state"].items():
        ref = by_fqn[fqn]
        state = optimizer.state[ref.shard]
        for key, value in saved_state.items():
            state[key] = _import_state(value, ref, state.get(key), group)
    for opt_group, saved in zip(optimizer.param_groups, osd["param_groups"]):
        opt_group.update((k, v) for k, v in saved.items() if k != "params")


def _import_state(value, ref, current, group):
    """This rank's optimizer state for one key, written into the current state
    tensor where one exists (DCP may have filled it already). A plain tensor
    counts as the full, unsharded state when this job keeps that key sharded
    (or, with no state yet, when it has the parameter's shape and is not 0-dim)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
        if current is not None:
            is_full = _is_sharded_state(current, ref)
        else:
            is_full = value.dim() > 0 and tuple(value.shape) == ref.shape
        if not is_full:
            return _replicated(value, current)
    elif not isinstance(value, torch.Tensor):
        return value
    target = current if _is_sharded_state(current, ref) else torch.zeros_like(ref.shard.detach())
    copy_into_flat(value, target, ref.shape, group)
    return target


def _replicated(value: torch.Tensor, current):
    if isinstance(current, torch.Tensor) and current.shape == value.shape:
        if current is not value:
            with torch.no_grad():
                current.copy_(value)
        return current
    return value.detach().clone()
