"""Layers that their container built as deep copies of one layer: the
replay initialises the first and copies its values into the others (see
[Note: init replay] in materialize.py).

torch's nn.TransformerEncoder and nn.TransformerDecoder take one layer the
caller built and fill their `layers` with deep copies of it. Built normally,
that layer's values were drawn once, before the container, and every copy
starts with those very values; the layer passed in is not kept. A model on
the meta device does not say that a module was deep-copied, so the
containers known to do it are named here.
"""

from __future__ import annotations

import torch

from sharc._state import state_of

# Container class -> its attributes that each hold one group of clones: a
# ModuleList its __init__ filled with deep copies of one module. Another
# container that deep-copies in its __init__ joins the table the same way.
_CLONING_CONTAINERS: dict[type, tuple[str, ...]] = {
    torch.nn.TransformerEncoder: ("layers",),
    torch.nn.TransformerDecoder: ("layers",),
}


def _clone_groups(module: torch.nn.Module) -> list[list[torch.nn.Module]]:
    for cls, attributes in _CLONING_CONTAINERS.items():
        if isinstance(module, cls):
            return [list(getattr(module, name)) for name in attributes]
    return []


def prototypes(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The id of each module inside a clone (every member of a group but the
    first) -> the module at the same place in the group's first member,
    whose values it takes. The first member stands for the layer the copies
    were made from: it is initialised where it sits in construction order.
    A member laid out otherwise than the first was replaced after
    construction: it is no copy, and is initialised as built."""
    found: dict[int, torch.nn.Module] = {}
    for container in model.modules():
        for first, *rest in filter(None, _clone_groups(container)):
            places, layout = dict(first.named_modules()), _layout(first)
            for clone in rest:
                if _layout(clone) != layout:
                    continue
                for name, sub in clone.named_modules():
                    # Outer containers come first: inside an outer copy, a
                    # nested group was copied whole with it.
                    found.setdefault(id(sub), places[name])
    return found


def _layout(module: torch.nn.Module) -> list:
    """What two deep copies of one module share: module names and types,
    and each module's parameters' and buffers' names, shapes and dtypes."""
    layout = []
    for name, sub in module.named_modules():
        state = state_of(sub)
        params = {local: (ref.shape, ref.shard.dtype)
                  for local, ref in (state.refs.items() if state is not None else ())}
        buffers = {local: (b.shape, b.dtype) for local, b in sub._buffers.items() if b is not None}
        layout.append((name, type(sub), params, buffers))
    return layout


def copy_values(progress, clone: torch.nn.Module, prototype: torch.nn.Module) -> None:
    """The initialiser of `clone` on its unit (its parameters full-size in
    `clone._parameters`): its own parameters and buffers take `prototype`'s
    values, no random draw. A parameter of the prototype without values
    leaves the clone's without either, so both are named as missing.
    Gathers: every rank copies the same modules in the same order."""
    state = state_of(prototype)
    for local, ref in (state.refs.items() if state is not None else ()):
        values = progress.gathered(ref.pid)
        if values is not None:
            clone._parameters[local].copy_(values)
    for local, source in prototype._buffers.items():
        if source is not None:
            clone._buffers[local].copy_(source)
