"""Hugging Face models: what `PreTrainedModel.post_init()` does at
construction, replayed one module at a time.

Every transformers `PreTrainedModel` ends its `__init__` with `post_init()`,
which initialises its whole subtree (`_initialize_weights` on each module,
children before parents, a nested `PreTrainedModel` with its own, modules
already marked `_is_hf_initialized` skipped) and only then ties weights
(`tie_weights()`): an output head drew values for a weight of its own that
the tie then replaced. Under `torch.device("meta")` it skips the
initialisation altogether. sharc.init_weights() replays it where it ran,
right after the model's own submodules were built (a `LlamaForCausalLM`
holds a `LlamaModel`, initialised before the head is even built), with tied
weights as at construction. transformers is never imported here: a model
can only be one if the user imported it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch


def _pretrained_base():
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None)


def is_pretrained(module: torch.nn.Module) -> bool:
    base = _pretrained_base()
    return base is not None and isinstance(module, base)


def owners(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(module) -> the innermost PreTrainedModel holding it (or itself)."""
    out: dict[int, torch.nn.Module] = {}
    for _, module in model.named_modules():  # pre-order: inner models come later
        if is_pretrained(module):
            for _, sub in module.named_modules():
                out[id(sub)] = module
    return out


def _guarded():
    """transformers' own guard around its initialisation (its init functions
    skip tensors marked initialised), where it has one."""
    init = sys.modules.get("transformers.initialization")
    guard = getattr(init, "guard_torch_init_functions", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _initializer(model: torch.nn.Module):
    """`module -> None`: the model's `_initialize_weights` (which skips
    modules marked initialised and marks them)."""
    fn = model._initialize_weights
    if len(inspect.signature(fn).parameters) >= 2:  # transformers 5: (module, is_custom_code)
        # Asked of the model's own class: sharc's sharded subclass is defined
        # outside transformers, which would make any model "custom code", and
        # custom code skips every module whose own parameters are all marked
        # initialised (so every module without parameters of its own: a
        # model's root, whose `_init_weights` may write its children's).
        cls = getattr(model, "_sharc_original_class", type(model))
        custom = bool(getattr(cls, "is_custom_code", lambda: False)())
        return lambda module: fn(module, custom)
    return fn


def replay_post_init(model: torch.nn.Module, run) -> None:
    """Replays `model.post_init()`'s initialisation: `run(module, fn)` for each
    module of `model` in the order it visits them, skipping those an inner
    model's replay marked initialised already."""

    def visit(module: torch.nn.Module, init) -> None:
        for child in module.children():
            visit(child, _initializer(child) if is_pretrained(child) else init)
        if not getattr(module, "_is_hf_initialized", False):
            run(module, lambda: init(module))

    with _guarded():
        visit(model, _initializer(model))


def recompute_buffers(owner: torch.nn.Module, module: torch.nn.Module) -> None:
    """The buffers of `module` (a rotary embedding's frequencies, an
    embedding's `position_ids`) computed by `owner`'s initialisation. It may
    write the module's parameters too: a caller with values to keep runs it
    on stand-ins (`_init_unit.run_on_scratch`)."""
    with _guarded():
        owner._init_weights(module)


def converts_checkpoints(model: torch.nn.Module) -> str | None:
    """The class name or model type whose checkpoints transformers converts
    while loading (key renamings, per-expert tensors merged into one: its
    `conversion_mapping`, looked up for every model in the tree by class
    name, then by `config.model_type`), or None. sharc reads a file's tensors
    as they are, so such a file's keys may not be the model's."""
    if not is_pretrained(model):
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversions: files are as saved
        return None
    for _, sub in model.named_modules():
        if not is_pretrained(sub):
            continue
        cls = getattr(sub, "_sharc_original_class", type(sub)).__name__
        model_type = getattr(getattr(sub, "config", None), "model_type", None)
        for name in (cls, model_type):
            if name and get_checkpoint_conversion_mapping(name):
                return name
    return None
