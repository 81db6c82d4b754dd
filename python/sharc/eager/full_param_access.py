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
from torch.nn.utils import parametrize

from sharc._state import ModuleState, attach, state_of


def _full_param_property(name: str) -> property:
    def get(module: torch.nn.Module) -> torch.Tensor:
        state = module._sharc
        ref = state.refs[name]
        held = module._parameters.get(name, ref.shard)  # absent: a parametrization's
        if held is not ref.shard:
            return _substituted(state, ref, held)
        if torch.compiler.is_compiling():
            # Captured as a functional all-gather; sharc's backend schedules
            # it (see sharc/_compile), any other backend sees a plain value.
            return ref.traced_read()
        return state.schedule.read(ref, module)

    never_a_frame_of_its_own(get)
    never_a_frame_of_its_own(_substituted)
    return property(get, doc=f"The full (gathered) parameter '{name}'.")


def _substituted(state, ref, held: torch.Tensor | None) -> torch.Tensor | None:
    """[Note: a tensor put in place of a shard]
    torch.func.functional_call (and torch.nn.utils.stateless) swap a
    module's parameters by writing `module._parameters` for the call, which
    the class property above would never look at: the call would silently
    compute with the model's own weights. A full-size tensor put there is
    read as it is (no gather: it is the caller's, whole on this rank), cast
    to the gather dtype as a read of the shard would be; None drops the
    parameter, as torch does. sharc's own initialisation puts full tensors
    there too (`_init_unit.py`), which must come back as the same object
    for `nn.init` to write: never cast while the schedule reads an
    unsharded table. Non-strict torch.export puts a stand-in of the shard
    itself there, traced as the gather of that stand-in."""
    if held is None:
        return None
    if tuple(held.shape) == tuple(ref.shape):
        if state.schedule.unsharded is not None or held.dtype == ref.gather_dtype:
            return held
        return held.to(ref.gather_dtype)
    if torch.compiler.is_compiling() and held.shape == ref.shard.shape:
        return ref.traced_read(held)
    raise RuntimeError(
        f"sharc: the sharded parameter '{ref.fqn}' was replaced by a tensor of shape "
        f"{tuple(held.shape)} (torch.func.functional_call, torch.nn.utils.stateless, or a "
        f"write to module._parameters); a tensor put in its place must have the "
        f"parameter's full shape {tuple(ref.shape)}. To change the parameter itself, copy "
        "into it inside `with sharc.unsharded(model, writeback=True)`")


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
    module: refused before anything changes (a buffer anywhere below
    included) if it would change the dtype or device of a shard in the
    subtree, which the runtime registered and gathers into."""
    # A plain loop, no walrus inside a comprehension: that makes `state` a
    # cell variable, which Dynamo cannot read before it is set, and HF
    # models call `.to()` inside forward (a graph break per call).
    refs = []
    for sub in module.modules() if recurse else [module]:
        state = state_of(sub)
        if state is not None:
            refs.extend(state.refs.values())
    for ref in refs:
        shard = ref.shard
        given = torch.empty(0, dtype=shard.dtype, device=shard.device)
        probe = fn(given)
        if probe.dtype != shard.dtype or probe.device != shard.device:
            raise RuntimeError(
                f"sharc: cannot move or cast the sharded parameter '{ref.fqn}' "
                f"({shard.dtype}, {shard.device}) to ({probe.dtype}, {probe.device}) after "
                "sharc.shard(): convert the model before shard(), or compute in a lower "
                "precision with mixed precision (ShardConfig(mixed_precision="
                "sharc.MixedPrecision(param_dtype=...))) or torch.autocast")
        # A conversion to the shard's own dtype and device gives the tensor
        # back; one that makes a new tensor (Module.to_empty: torch.empty_like)
        # would put it in the shard's `.data`, where the runtime no longer
        # finds the shard it registered (an error at the next gather, naming
        # `.data`). Traced code (HF's `.to()` in forward) makes new proxies
        # for no-op conversions too, so only eager calls are judged.
        if probe is not given and not torch.compiler.is_compiling():
            raise RuntimeError(
                f"sharc: Module.to_empty() (or another conversion that allocates new "
                f"tensors) cannot replace the sharded parameter '{ref.fqn}' after "
                f"sharc.shard(): its shard is already allocated on {shard.device}, also "
                "for a model built on the meta device. Leave out to_empty(), and give the "
                "parameters their values with sharc.init_weights(model) (what each module's "
                "reset_parameters() draws) or sharc.load_full_state_dict(model, ...); to "
                "change them with your own code, write them inside `with "
                "sharc.unsharded(model, writeback=True):`")
    return super(type(module), module)._apply(fn, recurse)


def refuse_deepcopy(what: str):
    # The usual deep copy of a model in training is an EMA or SWA copy
    # (AveragedModel deep-copies in its constructor). A copy made before
    # shard() and left whole fails at its first update_parameters(model),
    # with torch's size mismatch between a full tensor and a shard; sharded
    # too, its parameters are shards of the same layout, which those
    # element-wise updates average exactly.
    raise RuntimeError(
        f"sharc: a sharded module ({what}) cannot be deep-copied: its parameters are shards "
        "owned by the process group's runtime. Deep-copy the model before sharc.shard(), or "
        "build a fresh model and load sharc.full_state_dict(model) into it. For an EMA or "
        "SWA copy (torch.optim.swa_utils.AveragedModel(model), timm's ModelEma), make it "
        "before sharc.shard(model) and shard it too (sharc.shard(ema)), so that its "
        "parameters are shards of the same layout as the model's")


def _setattr(module: torch.nn.Module, name: str, value) -> None:
    """Assigning a new tensor to a sharded name would leave the shard in
    `parameters()` and the runtime gathering the old value: refused."""
    refs = module.__dict__["_sharc"].refs
    if name in refs and isinstance(value, torch.Tensor):
        if value is module._parameters.get(name):
            return  # its own shard again (transformers' tie_weights on tied weights)
        raise RuntimeError(
            f"sharc: cannot assign a new tensor to the sharded parameter '{refs[name].fqn}' "
            "after sharc.shard(): change its values inside `with sharc.unsharded(model, "
            "writeback=True): module.<name>.copy_(new)`, or replace it before shard()")
    super(type(module), module).__setattr__(name, value)


def _deepcopy(module: torch.nn.Module, memo):
    refuse_deepcopy(module._sharc_original_class.__name__)


def _refuse_pickling(module: torch.nn.Module, protocol):
    """torch.save(model) and multiprocessing pickle a module whole; a sharded
    one would be saved as this rank's shards under a class sharc made at
    shard() (pickle cannot even find it by name)."""
    raise TypeError(
        f"sharc: a sharded module ({module._sharc_original_class.__name__}) cannot be "
        "pickled (torch.save(model), multiprocessing): its parameters are this rank's "
        "shards. Save the weights instead: torch.save(sharc.full_state_dict(model), path), "
        "or sharc.save_checkpoint(path, model, optimizer) for a resumable checkpoint, and "
        "build the model from its class to load them")


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """copy.copy would go through __reduce_ex__, refused above; a shallow
    copy shares the shards and the runtime, as it shares any module's
    parameters, so it stays what it was."""
    copied = type(module).__new__(type(module))
    copied.__dict__.update(module.__dict__)
    return copied


def _delattr(module: torch.nn.Module, name: str) -> None:
    """[Note: structure under a shard]
    Deleting a sharded name would drop the shard from `parameters()` while
    the runtime still gathers, reduces and counts it. torch's
    `register_parametrization` does exactly that after reading the
    parameter (a gathered copy, outside forward), leaving a parametrization
    over a copy no rank trains: refused here, before the module changes."""
    refs = module.__dict__["_sharc"].refs
    if name in refs:
        raise RuntimeError(
            f"sharc: cannot delete the sharded parameter '{refs[name].fqn}' after "
            "sharc.shard() (torch.nn.utils.parametrize.register_parametrization and "
            "torch.nn.utils.prune do so): register parametrizations and pruning before "
            "shard(), or on a model loaded from sharc.full_state_dict(model)")
    super(type(module), module).__delattr__(name)


def _register_parameter(module: torch.nn.Module, name: str, param) -> None:
    """torch refuses a plain tensor here too; this says where one usually
    comes from on a sharded model. See [Note: structure under a shard]."""
    if isinstance(param, torch.Tensor) and not isinstance(param, torch.nn.Parameter):
        raise TypeError(
            f"sharc: cannot register a plain tensor as the parameter '{name}' of a sharded "
            f"{module._sharc_original_class.__name__} (torch.nn.Parameter or None "
            "required). A sharded parameter read outside forward is a gathered copy, not a "
            "parameter, so torch.nn.utils.prune and parametrize cannot take it over after "
            "sharc.shard(): prune and parametrize before shard()")
    super(type(module), module).register_parameter(name, param)


def _refuse_prune_remove(module: torch.nn.Module) -> None:
    """`prune.remove` on a module pruned before shard() would assign the
    full masked weight to the shard's `.data`, replacing the shard the
    runtime gathers: refused on each pruning hook, before anything changes.
    See [Note: structure under a shard]."""
    from torch.nn.utils.prune import BasePruningMethod

    def refuse(owner):
        raise RuntimeError(
            f"sharc: cannot make pruning permanent (torch.nn.utils.prune.remove) on a "
            f"sharded {module._sharc_original_class.__name__}: it would replace the shard "
            "with the full masked weight. Make pruning permanent before sharc.shard(), or on a "
            "model loaded from sharc.full_state_dict(model)")

    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, BasePruningMethod):
            hook.remove = refuse


def _read_as_torch_refill_does(module: torch.nn.RNNBase, name: str) -> torch.Tensor:
    """One read of a recurrent weight as torch's refill makes it: `hasattr`,
    then `getattr`, each computing a parametrized weight anew."""
    hasattr(module, name)
    return getattr(module, name)


def _rnn_forward(module: torch.nn.RNNBase, *args, **kwargs):
    """[Note: a recurrent layer's weight list]
    nn.RNNBase (RNN, LSTM, GRU) hands its weights to its kernel as a list,
    `_flat_weights`, which it keeps between calls and refills only when a
    weight read gives another tensor. Kept as it is, the list holds every
    gathered weight past its release, so the eager schedule hands those
    buffers over to it (a warning per weight) and the whole layer stays
    full-size between steps, outside sharc's byte counts. On a sharded RNN
    the list lives for one forward: filled here by reads through sharc
    (gathered in this forward's scope), emptied before the scope closes,
    and left empty everywhere else (`_init_flat_weights`, called by shard()
    and by `_apply`).

    A parametrized weight (`parametrizations.spectral_norm(lstm,
    "weight_hh_l0")`) is computed anew at every read, and a parametrization
    with state advances at each: spectral_norm's power iteration updates its
    `_u`/`_v` buffers per read. So it is read as often as torch's own refill
    reads it (`RNNBase._update_flat_weights`): `_weights_have_changed` reads
    (`hasattr`, then `getattr`) up to the first weight that changed, which
    is the first parametrized one (a fresh tensor each read; plain weights
    are the same tensor), and `_init_flat_weights` then reads every weight
    with `hasattr` and `getattr`: four reads of the first parametrized
    weight, two of each later one. Read once each, spectral norm's
    estimates and so the normalised weights drifted from one process's."""
    names = module._flat_weights_names
    parametrized = {n for n in names if parametrize.is_parametrized(module, n)}
    if parametrized:  # _weights_have_changed stops at the first parametrized weight
        _read_as_torch_refill_does(module, next(n for n in names if n in parametrized))
    module._flat_weights = [_read_as_torch_refill_does(module, n) if n in parametrized
                            else getattr(module, n) for n in names]
    try:
        return super(type(module), module).forward(*args, **kwargs)
    finally:
        _empty_flat_weights(module)


def _empty_flat_weights(module: torch.nn.RNNBase) -> None:
    count = len(module._flat_weights_names)
    module._flat_weights = [None] * count
    module._flat_weight_refs = [None] * count


def kept_in_step_by_sharc(module: torch.nn.Module, attribute: str) -> bool:
    """Whether `module.<attribute>`, a container of the module's own
    parameters, is one sharc refills itself on the sharded module, so
    shard() need not refuse it ([Note: a parameter kept apart from its
    module] in _validate.py): a recurrent layer's weight list, see
    [Note: a recurrent layer's weight list]."""
    return isinstance(module, torch.nn.RNNBase) and attribute == "_flat_weights"


def _rnn_attributes(cls: type) -> dict:
    """See [Note: a recurrent layer's weight list]."""
    if not issubclass(cls, torch.nn.RNNBase):
        return {}
    return {
        "forward": _rnn_forward,
        "_init_flat_weights": _empty_flat_weights,
        "_update_flat_weights": lambda module: None,  # forward fills the list itself
        # cuDNN's flattening would move the gathered weights into a buffer of
        # its own (set_), outside sharc's accounting; they are gathered anew
        # each forward, so there is nothing lasting to flatten.
        "flatten_parameters": lambda module: None,
    }


@functools.lru_cache(maxsize=None)
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    attrs = {name: _full_param_property(name) for name in names}
    attrs["_sharc_original_class"] = cls
    attrs["_apply"] = _apply
    attrs["__deepcopy__"] = _deepcopy
    attrs["__reduce_ex__"] = _refuse_pickling
    attrs["__copy__"] = _shallow_copy
    attrs["__setattr__"] = _setattr
    attrs["__delattr__"] = _delattr
    attrs["register_parameter"] = _register_parameter
    attrs.update(_rnn_attributes(cls))
    # Under the original class's name: transformers' save_pretrained writes
    # type(model).__name__ into config.json's "architectures", which loaders
    # read to find the class, and repr() and error messages name it too.
    # __module__ stays sharc's: Dynamo treats a class whose __module__ is in
    # torch.nn as one of torch's own modules (as torch's parametrize, sharc
    # keeps its class out of that).
    attrs["__qualname__"] = cls.__qualname__
    return type(cls.__name__, (cls,), attrs)


def install(module: torch.nn.Module, state: ModuleState) -> None:
    """Makes `module.<name>` return the full parameter for every name in
    `state.refs`."""
    attach(module, state)
    module.__class__ = _sharded_class(type(module), tuple(sorted(state.refs)))
    _refuse_prune_remove(module)
    if isinstance(module, torch.nn.RNNBase):
        _empty_flat_weights(module)  # it held the unsharded parameters
