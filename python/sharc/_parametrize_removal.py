"""torch.nn.utils.parametrize.remove_parametrizations over a shard, refused
before it changes anything.

[Note: removing a parametrization after shard]
A model parametrized before shard() (weight_norm, orthogonal, a custom
parametrization) trains sharded: the tensors the parametrization holds
(`parametrizations.<name>.original`) are shards, read whole through sharc.
Removing the parametrization afterwards cannot work on them: torch would
put the parametrized value back on the module as a parameter of full size
that no shard backs, and it deletes the parametrization's property from the
module's class, which after shard() is sharc's subclass: it failed there
with an AttributeError that named neither sharc nor a fix (the shards were
left as they were, since the value torch set first was a gathered copy).
`install()` wraps torch's function once per process: a call on a
parametrization that holds a shard raises, naming what to do instead; any
other call is torch's own. Code that bound torch's function to a name of its
own before the first shard() reaches torch's function as it is.
"""

from __future__ import annotations

import functools

import torch

from sharc._shard_mark import SHARD_GROUP


def _holds_a_shard(module: torch.nn.Module, tensor_name) -> bool:
    lists = getattr(module, "parametrizations", None)
    if lists is None:
        return False
    names = [tensor_name] if tensor_name in lists else []
    return any(hasattr(p, SHARD_GROUP) for name in names for p in lists[name].parameters())


def install() -> None:
    """A second call does nothing."""
    from torch.nn.utils import parametrize

    torch_remove = parametrize.remove_parametrizations
    if getattr(torch_remove, "_sharc_wraps", None) is not None:
        return

    @functools.wraps(torch_remove)
    def remove_parametrizations(module, tensor_name, *args, **kwargs):
        if _holds_a_shard(module, tensor_name):
            owner = getattr(module, "_sharc_original_class", type(module))
            if owner.__name__.startswith("Parametrized"):  # torch's class around it
                owner = owner.__bases__[0]
            raise RuntimeError(
                f"sharc: cannot remove the parametrization of '{tensor_name}' on a sharded "
                f"{owner.__name__}: the tensors it holds are shards, and torch would put a "
                "full-size parameter no shard backs in their place. Remove parametrizations "
                "before sharc.shard(), or on a model loaded from sharc.full_state_dict(model)")
        return torch_remove(module, tensor_name, *args, **kwargs)

    remove_parametrizations._sharc_wraps = torch_remove
    parametrize.remove_parametrizations = remove_parametrizations
