"""`module.weight` yields the full parameter while `module._parameters`
holds the flat shard.

Each module that owns sharded parameters is moved to a subclass of its own
class with one property per sharded name. A property on the class wins over
nn.Module's attribute lookup, so forward code reads the full tensor, while
`parameters()`, `state_dict()` and optimizers see the shard under the
original name.
"""

from __future__ import annotations

import functools

import torch

from sharc._module_state import ModuleState, attach


def _full_param_property(name: str) -> property:
    def get(module: torch.nn.Module) -> torch.Tensor:
        state = module._sharc
        ref = state.refs[name]
        if torch.compiler.is_compiling():
            # Captured as a functional all-gather; sharc's backend schedules
            # it (see sharc/_compile), any other backend sees a plain value.
            return ref.traced_read()
        return state.schedule.read(ref)

    never_a_frame_of_its_own(get)
    return property(get, doc=f"The full (gathered) parameter '{name}'.")


def never_a_frame_of_its_own(fn) -> None:
    """[Note: sharc code is inlined or eager, never a compiled frame]
    When Dynamo gives up on a frame (a graph break in a loop, an exception),
    that frame runs eagerly and Dynamo compiles each function it calls as a
    frame of its own, sharc's property getter and module hooks among them.
    Compiled alone, the getter is a graph whose output is a full parameter (a
    copy nobody releases) and a hook does nothing (a scope entered eagerly is
    never left, or the reverse). Skipping their code objects as frames keeps
    them eager there, while Dynamo still inlines them into any frame it
    traces (inlining looks at `_torchdynamo_disable`, which stays unset)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)


def _apply(module: torch.nn.Module, fn, recurse: bool = True):
    """Module._apply (behind .to(), .float(), .cuda(), ...) on a sharded
    module: refused before anything changes if it would change a shard's
    dtype or device, which the runtime registered and gathers into."""
    for ref in module._sharc.refs.values():
        shard = ref.shard
        probe = fn(torch.empty(0, dtype=shard.dtype, device=shard.device))
        if probe.dtype != shard.dtype or probe.device != shard.device:
            raise RuntimeError(
                f"sharc: cannot move or cast the sharded parameter '{ref.fqn}' "
                f"({shard.dtype}, {shard.device}) to ({probe.dtype}, {probe.device}) after "
                "sharc.shard(): convert the model before shard(), or compute in a lower "
                "precision with mixed precision (ShardConfig(mixed_precision="
                "sharc.MixedPrecision(param_dtype=...))) or torch.autocast")
    return super(type(module), module)._apply(fn, recurse)


def refuse_deepcopy(what: str):
    raise RuntimeError(
        f"sharc: a sharded module ({what}) cannot be deep-copied: its parameters are shards "
        "owned by the process group's runtime. Deep-copy the model before sharc.shard(), or "
        "build a fresh model and load sharc.full_state_dict(model) into it")


def _setattr(module: torch.nn.Module, name: str, value) -> None:
    """Assigning a new tensor to a sharded name would leave the shard in
    `parameters()` and the runtime gathering the old value: refused."""
    refs = module.__dict__["_sharc"].refs
    if name in refs and isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"sharc: cannot assign a new tensor to the sharded parameter '{refs[name].fqn}' "
            "after sharc.shard(): change its values inside `with sharc.unsharded(model, "
            "writeback=True): module.<name>.copy_(new)`, or replace it before shard()")
    super(type(module), module).__setattr__(name, value)


def _deepcopy(module: torch.nn.Module, memo):
    refuse_deepcopy(module._sharc_original_class.__name__)


@functools.lru_cache(maxsize=None)
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    attrs = {name: _full_param_property(name) for name in names}
    attrs["_sharc_original_class"] = cls
    attrs["_apply"] = _apply
    attrs["__deepcopy__"] = _deepcopy
    attrs["__setattr__"] = _setattr
    return type(f"Sharded{cls.__name__}", (cls,), attrs)


def install(module: torch.nn.Module, state: ModuleState) -> None:
    """Makes `module.<name>` return the full parameter for every name in
    `state.refs`."""
    attach(module, state)
    module.__class__ = _sharded_class(type(module), tuple(sorted(state.refs)))
