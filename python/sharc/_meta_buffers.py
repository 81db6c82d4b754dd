"""The buffers of a model built on the meta device: given real storage, then
values, and checked to have them.

Buffers are not sharded (every rank holds each one whole), so they are
allocated whole on the shards' device. What was computed in a module's
`__init__` (a causal mask, a rotary table) ran on the meta device and is
gone; it must be computed again by the module's own code: its
`reset_buffers()` (sharc's hook, beside `reset_parameters()`), its
`reset_parameters()` (BatchNorm's resets its running statistics), a
Hugging Face model's own initialisation (its rotary tables), or the user's
`init_fn`; or loaded, if it is persistent. A buffer nothing wrote is an
error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sharc._init_unit import fresh, untouched


@dataclass(eq=False, slots=True)
class _MetaBuffer:
    fqn: str  # its first name in named_buffers() order
    places: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    value: torch.Tensor | None = None
    version: int = 0

    @property
    def persistent(self) -> bool:
        module, local = self.places[0]
        return local not in module._non_persistent_buffers_set


class MetaBuffers:
    """Every buffer of `model` still on the meta device (a buffer registered
    in several modules once)."""

    def __init__(self, model: torch.nn.Module):
        found: dict[int, _MetaBuffer] = {}
        for name, module in model.named_modules():
            for local, b in module._buffers.items():
                if b is not None and b.is_meta:
                    fqn = f"{name}.{local}" if name else local
                    found.setdefault(id(b), _MetaBuffer(fqn)).places.append((module, local))
        self.buffers = list(found.values())

    def allocate(self, device: torch.device) -> None:
        """Gives each one a real, sentinel-filled tensor on `device`."""
        for buf in self.buffers:
            meta = buf.places[0][0]._buffers[buf.places[0][1]]
            buf.value = fresh(meta.shape, meta.dtype, device)
            buf.version = buf.value._version
            for module, local in buf.places:
                module._buffers[local] = buf.value

    def by_tensor(self) -> dict[int, _MetaBuffer]:
        """Each allocated buffer by the id of its tensor (as a state dict
        taken after allocate() holds it, under each of its names)."""
        return {id(b.value): b for b in self.buffers}

    def without_values(self) -> list[_MetaBuffer]:
        return [b for b in self.buffers if untouched(b.value, b.version)]

    def raise_without_values(self, who: str) -> None:
        missing = self.without_values()
        if not missing:
            return
        module, _ = missing[0].places[0]
        cls = getattr(module, "_sharc_original_class", type(module)).__name__
        raise RuntimeError(
            f"{who}: the buffer '{missing[0].fqn}' ({cls}) was computed on the meta device "
            f"when the model was built and nothing computed it again"
            + (f" (nor {len(missing) - 1} more: "
               f"{[b.fqn for b in missing[1:4]]})" if len(missing) > 1 else "")
            + f". Give {cls} a reset_buffers() method that fills it in place (and call it from "
            "__init__, so both ways of building agree), or fill it in init_fn; a persistent "
            "buffer can also be loaded with sharc.load_full_state_dict")


def has_reset_buffers(module: torch.nn.Module) -> bool:
    return callable(getattr(type(module), "reset_buffers", None))
