"""Starting ranks: under torchrun (env:// rendezvous) or as N local processes."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank_main(rank: int, world_size: int, port: int, backend: str,
                     fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_rank(backend, fn, args)


def _run_rank(backend: str, fn: Callable, args: tuple) -> None:
    dist.init_process_group(backend)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, nproc: int, backend: str = "gloo", args: tuple = ()) -> None:
    """Runs fn(*args) on every rank with the default process group set up.
    Under torchrun this process is one rank; otherwise `nproc` local ranks
    are started and waited for (an error on any rank is raised here)."""
    if launched_by_torchrun():
        _run_rank(backend, fn, args)
        return
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    mp.start_processes(_local_rank_main, args=(nproc, _free_port(), backend, fn, args),
                       nprocs=nproc, start_method="spawn")


def threads_per_rank(world_size: int) -> int:
    """Split this machine's cores evenly between local ranks."""
    return max(1, (os.cpu_count() or 1) // world_size)


def configure_threads(world_size: int) -> None:
    torch.set_num_threads(threads_per_rank(world_size))
