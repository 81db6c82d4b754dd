"""sharc.init_weights(): random initialisation of a model built on the meta
device, straight into its shards, one module at a time.

[Note: init replay]
Built normally, a model draws its random values while it is constructed:
each module's `__init__` finishes by calling its `reset_parameters()`, and
submodules are built inside their parent's `__init__`, so the draws happen
children before parents, in the order the submodules were built. Some
models then run an initialisation of their own over everything at the end
of the root's `__init__` (`self.apply(self._init_weights)`; a Hugging Face
model's `post_init()`). Built on the meta device, nothing was drawn.
init_weights() replays the same draws, in the same order, from the same
random stream, module by module:

1. every module, children before parents (`named_modules()` registration
   order, each module once): its `reset_parameters()` (torch's
   MultiheadAttention: `_reset_parameters()`), or, for a leaf without one
   that can be built again from its attributes, a twin of it built where
   it was (_init_rebuild.py: its `__init__`'s draws, such as transformers'
   Conv1D's); then sharc's `reset_buffers()` hook; a transformers
   `PreTrainedModel` then replays its `post_init()` (_hf_init.py);
2. with `init_fn`: `init_fn(module)` for every module in `Module.apply`
   order, as a root `__init__` ending in `self.apply(init_fn)` does.

Each call runs on a unit (_init_unit.py): that module's parameters at full
size, gathered or fresh, scattered back into the shards afterwards; so the
extra memory is one module's parameters. Every rank runs the same calls in
the same order from the same seed, so every rank draws the same values and
keeps its own slice of them; the values are bitwise those of the model built
normally on the same device with the same seed.

Tied parameters. In step 1 the model is taken as it was while being built:
a tie (`head.weight = emb.weight`) replaced the later module's own weight
after that module had drawn values for it. So a tied parameter is
initialised once, by the first module holding it in `named_modules()`
order, and the later module's `reset_parameters()` draws into a scratch
copy that is dropped (the draws still advance the stream, as they did);
so does a write reaching it through the later module from elsewhere (a
transformers root's `_init_weights` writing its tied output head).
`post_init()` also runs before the tie. Step 2 runs on the tied model, as
`self.apply()` after the tie does: every module's write lands.

Cloned layers. torch's TransformerEncoder and TransformerDecoder fill their
`layers` with deep copies of one layer the caller built: its values were
drawn once, before the container, and every copy has them; the layer itself
is not registered. So in step 1 `layers[0]` stands for that layer and is
replayed where its subtree sits; each module of every later layer instead
runs a unit that copies the values of its counterpart in `layers[0]`
(parameters and buffers), drawing nothing (_init_clones.py names the
containers that clone).

Where the replay cannot match (docs/design/meta-init.md says what to do):
a submodule built in another order than it is registered in, or built and
then dropped; random values drawn in `__init__` outside `reset_parameters()`
by a module that cannot be built again (one with submodules, or whose
arguments are not kept as attributes): refused if nothing else initialises
it, and refused anyway if the draw wrote its parameter in place (an
`nn.init` call moves the meta tensor's version counter), since every later
draw would shift; `nn.Parameter(torch.randn(...))` under `init_fn` or a
transformers model leaves no such trace and shifts the stream (warned where
the module's `__init__` source shows the draw); a
write in an `__init__` to a parameter outside every initialiser replayed (a
parent zeroing its child's norm weight, a loop over `self.modules()` ending
the root's `__init__`): warned, as construction wrote that parameter more
often than the replay did; a
tie that hands an earlier module a later module's parameter; an `init_fn`
pass that ran before the tie; a module of the user's that deep-copies
submodules in its `__init__` (the replay draws for each copy).
"""

from __future__ import annotations

import functools
import warnings

import torch

from sharc import _hf_init, _init_clones, _init_rebuild, _rank_check
from sharc._init_unit import InitProgress
from sharc._meta_buffers import MetaBuffers, has_reset_buffers
from sharc._state import state_of
from sharc._state import sharded_root, unwrap_compiled


def init_weights(module: torch.nn.Module, init_fn=None) -> None:
    """Gives a model that sharc.shard() took from the meta device its
    initial values, as if it had been built normally with the same seed:
    each module's `reset_parameters()` in construction order, then
    `init_fn(module)` for every module if given (for a model whose
    `__init__` ends with `self.apply(init_fn)`). One module's parameters at
    a time are full-size, each rank keeping its slice. Buffers computed in
    `__init__` are computed again by the module's `reset_buffers()`. Seed
    every rank identically before building the model (sharc.shard() draws
    nothing). Collective: every rank must call it. See [Note: init replay]."""
    root = sharded_root(module)
    model = unwrap_compiled(module)
    pending = root.pending_init
    if pending is None:
        raise RuntimeError(
            "sharc.init_weights: this model already has its values (it was not built on the "
            "meta device, or was initialised or loaded since); to change values after "
            "shard(), write them inside `with sharc.unsharded(model, writeback=True):`")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"sharc.init_weights: init_fn must be callable (module -> None) or "
                        f"None, got {init_fn!r}")
    owners = _creators(model, root)
    hf_owners = _hf_init.owners(model)
    rebuilds = _check_initialisers(model, root, owners, init_fn, hf_owners,
                                   pending.written_when_built)
    root.checks.agree(_rank_check.INIT_WEIGHTS)
    buffers = MetaBuffers(model)
    buffers.allocate(pending.device)
    progress = InitProgress(root, state_of(model).schedule, pending.device, owners)
    with torch.no_grad():
        _replay_construction(model, progress, rebuilds)
        if init_fn is not None:
            for sub in _apply_order(model):
                progress.run(sub, functools.partial(init_fn, sub), as_constructed=False)
    _raise_without_values(progress.without_values())
    buffers.raise_without_values("sharc.init_weights")
    _warn_of_writes_not_replayed(progress, pending.written_when_built)
    root.pending_init = None
    pending.finish()


def _creators(model: torch.nn.Module, root) -> dict[int, torch.nn.Module]:
    """Parameter id -> the first module holding it in named_modules() order:
    the one taken to have created it (see the note on tied parameters)."""
    owners: dict[int, torch.nn.Module] = {}
    for _, sub in model.named_modules():
        for shard in sub._parameters.values():
            if shard is not None:
                owners.setdefault(root.refs_by_shard[id(shard)].pid, sub)
    return owners


def _construction_order(model: torch.nn.Module):
    """Modules in the order their `__init__` returned: children before their
    parent, siblings in registration order, each module once."""
    seen: set[int] = set()

    def visit(module):
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                yield from visit(child)
        yield module

    return list(visit(model))


def _apply_order(module: torch.nn.Module):
    """The modules `module.apply(fn)` calls fn on, in its order."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _reset_method(module: torch.nn.Module):
    """The module's `reset_parameters`, which its `__init__` ends with: the
    public name, or torch's MultiheadAttention's `_reset_parameters`."""
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(type(module), name, None)):
            return getattr(module, name)
    return None


def _replay_construction(model: torch.nn.Module, progress: InitProgress,
                         rebuilds: dict[int, _init_rebuild.Plan]) -> None:
    def run_as_built(sub, fn):
        progress.run(sub, fn, as_constructed=True)

    prototypes = _init_clones.prototypes(model)
    for sub in _construction_order(model):
        prototype = prototypes.get(id(sub))
        if prototype is not None:  # a deep copy: built with the values, drawing none
            progress.copied.update(_own_pids(sub))
            run_as_built(sub, functools.partial(_init_clones.copy_values, progress, sub,
                                                prototype))
            continue
        twin = rebuilds.get(id(sub))
        if twin is not None:  # its __init__ wrote its values: built again, drawing alike
            progress.copied.update(_own_pids(sub))
            run_as_built(sub, functools.partial(_init_rebuild.copy_from_twin, twin, sub,
                                                progress.device))
        reset = _reset_method(sub)
        if reset is not None:
            run_as_built(sub, reset)
        if has_reset_buffers(sub):
            run_as_built(sub, sub.reset_buffers)
        if _hf_init.is_pretrained(sub):
            _hf_init.replay_post_init(sub, run_as_built)


def _own_pids(module: torch.nn.Module) -> list[int]:
    state = state_of(module)
    return [ref.pid for ref in state.refs.values()] if state is not None else []


def _warn_of_writes_not_replayed(progress: InitProgress, written_when_built: dict[int, int]):
    """Construction wrote these parameters in place more often than the
    replay did: a write outside every initialiser the replay runs (a parent's
    `__init__` zeroing its child's norm weight, a loop over `self.modules()`
    ending the root's `__init__`) was lost, and the values are the child's
    own initialiser's, not a normal build's. Parameters that took a twin's
    or a prototype's values (one copy for all of `__init__`'s writes) are
    not counted."""
    lost = [ref.fqn for pid, ref in progress.refs.items()
            if pid not in progress.copied
            and progress.write_counts.get(pid, 0) < written_when_built.get(pid, 0)]
    if not lost:
        return
    warnings.warn(
        f"sharc.init_weights: building the model wrote the parameter '{lost[0]}'"
        + (f" (and {len(lost) - 1} more: {lost[1:4]})" if len(lost) > 1 else "")
        + " in place more often than its initialisers (reset_parameters(), init_fn) wrote it "
        "now: a write made elsewhere in an __init__ (a parent initialising a child's parameter, "
        "such as a zero-init of a block's last norm, or a loop over self.modules() at the end "
        "of the root's __init__) cannot be replayed, so these values (and every value drawn "
        "after such a write, if it drew) may differ from a normal build with the same seed. Move "
        "the write into the parent's reset_parameters() (init_weights calls it after its "
        "children's), pass the loop as init_fn, or load the values with "
        "sharc.load_full_state_dict", stacklevel=3)


def _class_name(module: torch.nn.Module) -> str:
    return getattr(module, "_sharc_original_class", type(module)).__name__


def _check_initialisers(model, root, owners, init_fn, hf_owners,
                        written_when_built) -> dict[int, _init_rebuild.Plan]:
    """Before anything is written: every parameter's creator, and every
    module holding a buffer still on the meta device, has something that
    can initialise it, and no module's `__init__` wrote values the replay
    cannot write again. Returns the modules built again (_init_rebuild.py):
    id -> how."""
    rebuilds: dict[int, _init_rebuild.Plan] = {}
    for name, sub in model.named_modules():
        if _reset_method(sub) is not None:
            continue
        pids = {local: root.refs_by_shard[id(p)].pid for local, p in sub._parameters.items()
                if p is not None}
        created = [local for local, pid in pids.items() if owners[pid] is sub]
        why = ""
        if created:
            twin, why = _init_rebuild.plan(sub)
            if twin is not None:
                rebuilds[id(sub)] = twin
                continue
            written = [local for local in created if pids[local] in written_when_built]
            # With init_fn the user names an initialiser that may write them
            # again (a root whose __init__ ends with `self.apply(init)`
            # writing its own cls_token): bitwise unless the module also drew
            # while it was built, which the branch below warns of; a parameter
            # init_fn leaves unwritten is refused after the replay.
            if written and init_fn is None:
                cls = _class_name(sub)
                raise RuntimeError(
                    f"sharc.init_weights: module '{name}' ({cls}) writes its parameters "
                    f"{[_join(name, w) for w in written]} in its __init__ (an nn.init call or "
                    "another in-place write) and has no reset_parameters(). Built normally, "
                    "those draws come from the random stream where the module is built; on "
                    "the meta device they drew nothing, and sharc cannot draw them again: "
                    f"{why}. So this module's values, and those of every module built after "
                    f"it, would differ from a normal build. Give {cls} a reset_parameters() "
                    "that initialises them in place (and call it from __init__), keep each "
                    f"argument of {cls}.__init__ as an attribute of the same name (sharc then "
                    "builds the module again, drawing alike), pass init_fn=(module -> None) "
                    "that initialises them (the function the model's __init__ applies to "
                    "its modules), or load values with sharc.load_full_state_dict")
        if init_fn is not None or id(sub) in hf_owners:
            draw = _init_rebuild.draw_in_init(sub) if created else None
            if draw is not None:
                warnings.warn(
                    f"sharc.init_weights: module '{name}' ({_class_name(sub)}) draws random "
                    f"numbers in its __init__ (`{draw}`) and cannot be built again ({why}). "
                    "On the meta device that draw took nothing from the random stream, so "
                    "every value drawn after it differs from a normal build with the same "
                    "seed (still initialised, not bitwise). Load the values with "
                    "sharc.load_full_state_dict where they must match", stacklevel=3)
            continue  # they may cover anything; what they leave is found afterwards
        if created:
            leaf = next(sub.children(), None) is None
            raise RuntimeError(
                f"sharc.init_weights: module '{name}' ({_class_name(sub)}) creates the "
                f"parameters {[_join(name, c) for c in created]} but has no "
                "reset_parameters(), so nothing can initialise them. Give "
                f"{_class_name(sub)} a reset_parameters() that initialises them in place (and "
                "call it from __init__, so both ways of building agree), pass "
                "init_fn=(module -> None) to sharc.init_weights, or load values with "
                "sharc.load_full_state_dict"
                + (f" (sharc builds such a module again from its __init__ arguments, but "
                   f"{why})" if leaf else ""))
        meta = [local for local, b in sub._buffers.items() if b is not None and b.is_meta]
        if meta and not has_reset_buffers(sub):
            raise RuntimeError(
                f"sharc.init_weights: the buffer '{_join(name, meta[0])}' "
                f"({_class_name(sub)}) was computed on the meta device when the model was "
                f"built, and {_class_name(sub)} has no reset_buffers() or reset_parameters() "
                "to compute it again. Give it a reset_buffers() that fills its buffers in "
                "place (and call it from __init__), or pass init_fn")
    return rebuilds


def _join(prefix: str, local: str) -> str:
    return f"{prefix}.{local}" if prefix else local


def _raise_without_values(names: list[str]) -> None:
    if not names:
        return
    raise RuntimeError(
        f"sharc.init_weights: no initialiser wrote the parameter '{names[0]}'"
        + (f" (nor {len(names) - 1} more: {names[1:4]})" if len(names) > 1 else "")
        + "; the others have their values, the model still awaits these. Its module's "
        "reset_parameters() or init_fn must initialise it in place, through the module "
        "attribute (`module.weight`), or load the model's values with "
        "sharc.load_full_state_dict")
