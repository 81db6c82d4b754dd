"""Parameters added to a model after shard() are refused where they are added.

[Note: added after shard]
shard() turns every parameter of the model into a shard it gathers, reduces
and steps. A parameter that enters the model later (a new head assigned,
`register_parameter`, transformers' `resize_token_embeddings` replacing the
output layer, adapters injected) is none of those: each rank keeps its own
full copy, its gradient is never averaged, and the ranks' copies part after
the first step, silently. So once a model is sharded, every module in it is
marked, and torch's global registration hooks (which nn.Module's
`__setattr__`, `register_module` and `register_parameter` call) refuse a
parameter that is not a shard, or a module holding one, entering a marked
module. Modules without parameters (an activation swapped) and modules that
hold only shards (one sharded module assigned under a second name, or again
under its own, as HF's router does with `.to()` in forward) pass, and become
marked. sharc's own code writes `_parameters` directly, past these hooks.
Inside a compiled frame the hooks return at once: Dynamo would otherwise
trace them into every forward that reassigns a submodule.
"""

from __future__ import annotations

import functools

import torch

from sharc._shard_mark import SHARD_GROUP

_MEMBER = "_sharc_member"  # on every module of a sharded model


def mark(module: torch.nn.Module) -> None:
    for sub in module.modules():
        object.__setattr__(sub, _MEMBER, True)


@functools.cache
def install() -> None:
    from torch.nn.modules.module import (register_module_module_registration_hook,
                                         register_module_parameter_registration_hook)

    register_module_module_registration_hook(_on_module)
    register_module_parameter_registration_hook(_on_parameter)


def _is_shard(p: torch.nn.Parameter) -> bool:
    return getattr(p, SHARD_GROUP, None) is not None


def _on_module(parent: torch.nn.Module, name: str, value):
    if torch.compiler.is_compiling() or _MEMBER not in parent.__dict__:
        return None
    if value is None or parent._modules.get(name) is value:
        return None  # removed, or assigned again (`self.x = self.x.to(...)`)
    for local, p in value.named_parameters():
        if not _is_shard(p):
            _refuse(f"the module '{name}' ({type(value).__name__}), whose parameter "
                    f"'{local}' is not sharded, to a sharded model")
    mark(value)
    return None


def _on_parameter(module: torch.nn.Module, name: str, param):
    if torch.compiler.is_compiling() or _MEMBER not in module.__dict__:
        return None
    if param is not None and not _is_shard(param):
        owner = getattr(type(module), "_sharc_original_class", type(module)).__name__
        _refuse(f"the parameter '{name}' (shape {tuple(param.shape)}) to a {owner} of a "
                "sharded model")
    return None


def _refuse(what: str) -> None:
    raise RuntimeError(
        f"sharc: cannot add {what} after sharc.shard(): sharc does not "
        "gather, reduce or shard it, so each rank would train its own copy apart from the "
        "others. Make structural changes (new heads or layers, "
        "resize_token_embeddings, adapters) before shard(), or keep the module outside "
        "the sharded model")
