"""Host memory freed by sharc's one-at-a-time loops, given back at once.

Initialising (materialize.py) or loading (checkpoint/load.py) a model one module or
one tensor at a time allocates and frees full-size temporaries over and
over. glibc serves a large allocation from mmap and returns it to the
system when freed, but each such free raises its threshold to that size
(up to 32 MiB), and later allocations below it come from its heaps, which
keep what is freed: the resident set then grows by several modules'
temporaries (measured: about three modules' parameters over a GPT's
initialisation, bench/meta_init_memory.py). Trimming the heaps after each
step keeps the peak at one module's temporaries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def give_back_freed_memory(device: torch.device) -> None:
    """Returns host memory freed so far to the operating system (glibc's
    malloc_trim; nothing elsewhere, nor for other devices, whose
    allocators keep their own caches). Cheap next to a module's
    initialisation or a tensor's read."""
    trim = _malloc_trim() if device.type == "cpu" else None
    if trim is not None:
        trim(0)
