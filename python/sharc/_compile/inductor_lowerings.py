"""Inductor lowerings for sharc's ops where Inductor's defaults are unsafe.

A `wait_gather` output is an alias of a runtime buffer whose storage
`release` frees in place. Inductor may hand a buffer whose last use has
passed to a later kernel's output (buffer reuse); for a released gathered
buffer that would write into freed storage. The lowering runs the op as the
usual fallback kernel and marks its outputs never to be reused.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor import lowering
from torch._inductor.virtualized import V

from sharc._compile.ops import WAIT_GATHER


@functools.cache
def register() -> None:
    fallback = lowering.fallback_handler(WAIT_GATHER, add_to_fallback_set=False)

    @lowering.register_lowering(WAIT_GATHER, type_promotion_kind=None)
    def _wait_gather(*args, **kwargs):
        outputs = fallback(*args, **kwargs)
        for out in torch.utils._pytree.tree_leaves(outputs):
            V.graph.never_reuse_buffers.add(out.get_name())
        return outputs
