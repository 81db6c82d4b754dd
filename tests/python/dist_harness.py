"""Runs a function on N real gloo ranks (separate processes) and returns each
rank's result, re-raising the first rank's error with its traceback.

A rank that neither returns nor fails within `timeout` seconds fails the test
(all ranks are killed), so a hang never stalls the suite; so does a rank that
returns and then does not exit with status 0.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback

# [Note: ranks compile in rank order]
# Every rank compiles the same graphs, and on this 2-core host the ranks of
# two tests at once share two cores: rank 1's Inductor work duplicated rank
# 0's, which is most of a compiled test's time. Each rank > 0 therefore waits
# for rank 0 to finish compiling its graph of the same index before compiling
# it, and so loads rank 0's output from Inductor's FX graph cache. That is
# what local ranks sharing the default cache directory see on a real host
# (any skew between them makes the later ones hit), and it runs sharc's cache
# keys ([Note: sharc and Inductor's caches]) in every compiled test. Nothing
# inside Inductor's compile communicates (sharc's passes, which may, run
# before it), so rank 0 never waits for a waiting rank; ranks whose graphs
# differ in number (routing that differs) stop waiting after the first wait
# that finds rank 0 not started, at most START_WAIT_S, and so do ranks whose
# cache directory is not rank 0's (tests of the cache give each rank its own).
# Measured over the whole suite (2026-11-29, fresh cache), leaving out the
# cache tests' own directories: ranks > 0 found 700 of their 803 graphs in
# the cache. Of the 103 misses, 66 are test_divergent_ranks.py's (routing
# that differs per rank makes other graphs); most of the rest are profiled
# schedules that place compute between the same collectives differently on
# each rank (each rank's own measured costs, sharc/_compile/profile.py).
START_WAIT_S = 5.0
DONE_WAIT_S = 600.0


def _compile_in_rank_order(rank, marker_dir):
    from torch._inductor import compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    original = compile_fx._compile_fx_inner
    state = {"index": 0, "waiting": rank > 0}

    def _wait_for(path, seconds):
        deadline = time.monotonic() + seconds
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _same_cache(started):
        with open(started) as f:
            return f.read() == cache_dir()

    def ordered(*args, **kwargs):
        index = state["index"]
        state["index"] += 1
        started = os.path.join(marker_dir, f"compile{index}.started")
        done = os.path.join(marker_dir, f"compile{index}.done")
        if state["waiting"]:
            state["waiting"] = (_wait_for(started, START_WAIT_S)
                                and _same_cache(started) and _wait_for(done, DONE_WAIT_S))
        if rank == 0:
            with open(started + ".tmp", "w") as f:  # whole when it appears
                f.write(cache_dir())
            os.replace(started + ".tmp", started)
        try:
            return original(*args, **kwargs)
        finally:
            if rank == 0:
                open(done, "w").close()

    compile_fx._compile_fx_inner = ordered



def _rank_main(fn, rank, world_size, init_file, conn, args, init_group, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world_size > 1:
        _compile_in_rank_order(rank, os.path.dirname(init_file))
    torch.manual_seed(0)  # every rank builds the same model unless a test says otherwise
    try:
        if init_group:
            dist.init_process_group(backend, init_method=f"file://{init_file}",
                                    rank=rank, world_size=world_size)
            if world_size > 1:
                # As for sharc's own groups ([Note: a group's last handshake]
                # in sharc/_rank_check.py): measured 1 to 4 failures in 30
                # two-rank launches of a function that returns at once.
                dist.barrier()
        # Plain pickle: torch's multiprocessing reducers would share tensors
        # through file descriptors that vanish when this process exits.
        conn.send_bytes(pickle.dumps(("ok", fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


class RankFailure(AssertionError):
    pass


def _context(backend: str = "gloo"):
    """Ranks fork from a server process that has imported torch and sharc
    once (multiprocessing's forkserver): each rank starts in a fraction of a
    second instead of importing torch anew, and still starts clean, from a
    process that never ran a test. Ranks on a GPU are spawned instead: the
    server's imports start CUDA there (Inductor asks for the device), and a
    forked child cannot start it again."""
    if "nccl" in backend or "cuda" in backend:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "torch._inductor.compile_fx", "sharc", "dist_harness"])
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 240, init_group: bool = True,
              backend: str = "gloo"):
    ctx = _context(backend)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        pipes, procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main,
                            args=(fn, rank, world_size, init_file, child, args, init_group,
                                  backend))
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        try:
            results = _collect(pipes, procs, timeout)
            _check_exits(procs)
            return results
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()


def _check_exits(procs, grace_s: float = 60.0):
    """Every rank that returned a result must also exit, with status 0: a
    crash while tearing down (destroy_process_group, the interpreter's exit)
    happens after the result is out and would otherwise pass unseen."""
    deadline = time.monotonic() + grace_s
    for rank, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            raise RankFailure(f"rank {rank} returned its result but did not exit within "
                              f"{grace_s:.0f}s (stuck tearing down)")
        if proc.exitcode != 0:
            raise RankFailure(f"rank {rank} returned its result, then exited with status "
                              f"{proc.exitcode} (a negative status is the signal that ended it)")


def _collect(pipes, procs, timeout):
    deadline = time.monotonic() + timeout
    results = []
    for rank, (conn, proc) in enumerate(zip(pipes, procs)):
        remaining = max(0.0, deadline - time.monotonic())
        if not conn.poll(remaining):
            raise RankFailure(f"rank {rank} gave no result within {timeout}s "
                              f"(alive={proc.is_alive()}, exitcode={proc.exitcode})"
                              + _others(pipes, procs, rank))
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except EOFError:
            proc.join(5)
            raise RankFailure(f"rank {rank} died (exit code {proc.exitcode})"
                              + _others(pipes, procs, rank)) from None
        if status == "error":
            raise RankFailure(f"rank {rank} failed:\n{value}" + _others(pipes, procs, rank))
        results.append(value)
    return results


def _others(pipes, procs, failed: int, wait_s: float = 5.0) -> str:
    """What became of every other rank, for a failure's message: a rank's
    error is often only the echo of a peer that crashed first (a closed
    connection), and the peer's fate is the cause. Ranks before `failed`
    returned their results already; the later ones get `wait_s` in all."""
    deadline = time.monotonic() + wait_s
    lines = [f"rank {rank}: returned a result" for rank in range(failed)]
    for rank, (conn, proc) in enumerate(zip(pipes, procs)):
        if rank <= failed:
            continue
        fate = "still running"
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                status, value = pickle.loads(conn.recv_bytes())
                fate = ("returned a result" if status == "ok"
                        else "failed too:\n" + value.rstrip()[-3000:])
        except EOFError:
            proc.join(max(0.0, deadline - time.monotonic()))
            fate = f"died without a result (exit code {proc.exitcode})"
        lines.append(f"rank {rank}: {fate}")
    return "\n-- the other ranks --\n" + "\n".join(lines) if lines else ""
