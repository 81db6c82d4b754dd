"""How many threads a rank computes with, and how many gloo's own threads get.

[Note: one thread for gloo's threads]
gloo runs each collective on a worker thread of its process group, and for
an all-gather torch's gloo backend copies the gathered bytes from a buffer
of its own into the output there. A copy above ATen's grain size is a
parallel loop, and a thread's first parallel loop gives that thread the
number of threads last passed to `torch.set_num_threads`, so the gloo
thread starts an OpenMP team of its own as large as the rank's. With
libgomp, once a process has more OpenMP threads than CPUs it may use, every
team's idle threads sleep at once instead of spinning briefly, and each
parallel region afterwards wakes its threads through the kernel: on this
project's 2-core host a rank computing with 2 threads took 2.5x as long per
small matmul after its first large all-gather, for the rest of the process
(`bench/compute_threads.py`). DDP's all-reduce works in place and never
copies there; sharc's gathers, and FSDP2's, do.

`configure(n)` (the launcher's and the trainer's threads per rank) gives
the calling thread `n` threads and every thread that starts parallel work
later one: torch's count set to 1 (what later threads take), then this
thread's own OpenMP and MKL counts set back to `n` through their per-thread
settings. gloo's copies then run on the gloo thread alone, no team is
started there, and the rank's own compute keeps its `n`. Where the build
lacks what that needs (another OpenMP runtime, MKL without its per-thread
setter, another platform) it falls back to `torch.set_num_threads(n)`.
`shard()` over a group that communicates on the CPU keeps the calling
thread's count the same way (`keep_for_this_thread`), for ranks started by
other launchers.

Limits: a thread the user starts later computes with one thread; torch's
pthreadpool (QNNPACK, XNNPACK) keeps the count of 1 that torch's setter
gives it; and a later `torch.set_num_threads(n)` hands gloo threads that
have not yet copied anything `n` again.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


@functools.cache
def _per_thread_setters():
    """(omp_set_num_threads, MKL's per-thread setter or None) of the libraries
    torch runs on; None where torch's OpenMP is not libgomp."""
    if not torch.backends.openmp.is_available() or not os.path.exists("/proc/self/maps"):
        return None
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line.split()[-1]}
    if len(paths) != 1:  # none, or two runtimes: which one torch uses is unclear
        return None
    omp_set = ctypes.CDLL(paths.pop()).omp_set_num_threads
    omp_set.argtypes, omp_set.restype = [ctypes.c_int], None
    mkl_set = None
    if torch.backends.mkl.is_available():
        torch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        # MKL linked into torch: its C entry point (by value), not the
        # Fortran-style lowercase names, which take a pointer.
        mkl_set = getattr(ctypes.CDLL(torch_cpu), "MKL_Set_Num_Threads_Local", None)
        if mkl_set is None:
            return None  # MKL would stay at one thread for this thread's matmuls
        mkl_set.argtypes, mkl_set.restype = [ctypes.c_int], ctypes.c_int
    return omp_set, mkl_set


def configure(threads: int) -> None:
    """The calling thread computes with `threads` intra-op threads; threads
    that start parallel work later (gloo's) with one. See the note above."""
    if threads < 1:
        raise ValueError(f"sharc: threads must be at least 1, got {threads}")
    setters = None if threads == 1 else _per_thread_setters()
    if setters is None:
        torch.set_num_threads(threads)
        return
    omp_set, mkl_set = setters
    # A thread takes torch's count at its first parallel loop or count query,
    # this one too: that happens now, before the count becomes 1.
    torch.get_num_threads()
    torch.set_num_threads(1)
    omp_set(threads)
    if mkl_set is not None:
        mkl_set(threads)
    if torch.get_num_threads() != threads:  # the setters did not reach torch's runtime
        torch.set_num_threads(threads)


def keep_for_this_thread() -> None:
    """`configure` with the calling thread's present count."""
    configure(torch.get_num_threads())
