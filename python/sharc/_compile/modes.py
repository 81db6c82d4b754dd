"""torch.compile's `mode=` under backend="sharc".

[Note: compile modes]
torch.compile hands a backend other than Inductor its mode as a keyword,
and sharc once swallowed it: `mode="max-autotune-no-cudagraphs"` compiled
with the defaults, silently. A mode's Inductor settings now apply to the
graphs sharc hands Inductor, except those sharc's graphs cannot take:
- CUDA graphs (`reduce-overhead`, `max-autotune`) would replay sharc's
  gathers and reductions without the runtime that issues and accounts for
  them. They are left off, as Inductor itself leaves them off for a graph
  with no CUDA tensor, so on the CPU nothing is said; a CUDA graph is
  compiled without them and warned of once.
- `lite`'s settings skip the joint-graph pass in which sharc makes backward
  gather again (and the passes after it): its graphs compile with the
  defaults, warned of once.
A mode torch does not know raises torch's own error, naming the modes.
"""

from __future__ import annotations

import warnings

_HONOURED = frozenset({"max_autotune", "coordinate_descent_tuning"})
_CUDA_GRAPHS = "triton.cudagraphs"
_WARNED: set[tuple[str, tuple[str, ...]]] = set()  # (mode, dropped settings) said once


def inductor_settings(mode: str | None, example_inputs) -> dict:
    """The settings of `mode` that sharc's graphs take; the rest are left
    off, warned of once where they would have acted."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    settings = list_mode_options(mode)  # torch's error names the modes there are
    dropped = sorted(k for k in settings if k not in _HONOURED)
    on_cuda = any(getattr(x, "is_cuda", False) for x in example_inputs)
    said = tuple(k for k in dropped if k != _CUDA_GRAPHS or on_cuda)
    if said and (mode, said) not in _WARNED:
        _WARNED.add((mode, said))
        warnings.warn(_dropped_message(mode, said), stacklevel=2)
    return {k: v for k, v in settings.items() if k in _HONOURED}


def _dropped_message(mode: str, dropped: tuple[str, ...]) -> str:
    why = ("CUDA graphs would replay sharc's gathers and reductions without the runtime "
           "that issues them" if dropped == (_CUDA_GRAPHS,) else
           "they skip the joint-graph pass in which sharc makes backward gather again")
    kept = "its other settings apply" if dropped == (_CUDA_GRAPHS,) else "the defaults apply"
    return (f"sharc: torch.compile(mode={mode!r}) with backend='sharc' leaves off "
            f"{', '.join(dropped)} ({why}); {kept}. "
            "mode='max-autotune-no-cudagraphs' takes every setting it names")
