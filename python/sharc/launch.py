"""Starting ranks: under torchrun (env:// rendezvous) or as N local processes.

[Note: failing fast]
A rank that fails must not leave the others waiting in a collective for the
process group's timeout. The local launcher starts the ranks itself and
watches them: the moment a rank's function raises (reported before any
clean-up of its own runs) or a rank exits with a non-zero code, every rank is
stopped and `launch` raises `LaunchError` with the failing rank's traceback.

A rank can also fail and then not return at all, e.g. by sleeping or waiting
in a `finally` block of its own. Each rank's watcher thread reports an
exception its main thread has been handling for a watch period; a rank that
has been handling one for `handling_grace_s` (10 s by default) while another
rank goes on without one (waiting for it in a collective, most likely)
counts as failed, and the job stops, naming that rank and its traceback. A
rank cannot tell a `finally` that never ends from an `except` block that
takes long (a retry's back-off, a fallback download), so the grace is a
trade: long enough for a handler that recovers, short enough to stop a
stuck job within seconds; `launch(..., handling_grace_s=None)` turns the
check off (the collective timeout still applies). When every rank is
handling an exception (all ranks saving a last checkpoint before they
re-raise, say), nobody is stopped: they may be working together. A rank
stuck any other way is caught when the others' collectives time out
(`timeout`, shorter than torch's default).

Under torchrun each rank runs `fn` in place; an exception aborts the process
group instead of the orderly shutdown (which can block on a peer) and is
re-raised, so the process exits at once and torchrun stops the other ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sharc import compute_threads

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long a collective waits for the other ranks before it fails (torch's
own default is 30 minutes for gloo, 10 for NCCL)."""

_WATCH_PERIOD_S = 0.25
_EXIT_GRACE_S = 30.0
_SETTLE_S = 2.0  # after a first failure, for the rest to exit or report
DEFAULT_HANDLING_GRACE_S = 10.0
"""How long a rank may handle an exception alone before it counts as failed."""


class LaunchError(RuntimeError):
    """A rank failed; the job was stopped. `rank` is the rank that failed
    first, `reports` each rank's error text (where it gave one)."""

    def __init__(self, message: str, rank: int, reports: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.reports = reports


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_timeout(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"launch(timeout=...) must be a positive number of seconds or a "
                         f"datetime.timedelta, got {timeout!r}")
    return timeout


def launch(fn: Callable, nproc: int, backend: str = "gloo", args: tuple = (),
           timeout: timedelta | float | None = None,
           handling_grace_s: float | None = DEFAULT_HANDLING_GRACE_S) -> None:
    """Runs fn(*args) on every rank with the default process group set up.

    Under torchrun this process is one rank; otherwise `nproc` local ranks are
    started (spawned: `fn` and `args` must be picklable) and watched. If any
    rank fails, all are stopped within seconds and `LaunchError` is raised
    with the failing rank's traceback (see [Note: failing fast]). `timeout`
    (seconds or a timedelta, default `DEFAULT_TIMEOUT`) bounds how long a
    collective waits for the other ranks; `handling_grace_s` how long a
    local rank may handle an exception while another runs on (None: no
    limit).
    """
    timeout = _as_timeout(timeout)
    if not callable(fn):
        raise TypeError(f"launch(fn, ...): fn must be callable, got {type(fn).__name__}")
    if launched_by_torchrun():
        _run_rank(backend, timeout, fn, args)
        return
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an int of at least 1, got {nproc!r}")
    if handling_grace_s is not None and (isinstance(handling_grace_s, bool) or not isinstance(
            handling_grace_s, (int, float)) or not handling_grace_s > 0):
        raise ValueError(f"launch(handling_grace_s=...) must be a positive number of seconds "
                         f"or None, got {handling_grace_s!r}")
    _check_picklable(fn, args)
    _LocalJob(nproc, backend, timeout, handling_grace_s).run(fn, args)


def _check_picklable(fn: Callable, args: tuple) -> None:
    """Spawned ranks receive fn and args pickled: fail here, before any
    rank starts, rather than in the middle of starting them."""
    try:
        pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001  (pickling raises several types)
        raise TypeError(
            f"launch(fn, ...): fn and args must be picklable to start local ranks ({e}); "
            "define fn at the top level of a module (not a lambda or a nested function) "
            "and pass plain data in args") from e


def _run_rank(backend: str, timeout: timedelta, fn: Callable, args: tuple,
              on_error: Callable[[str], None] | None = None) -> None:
    """One rank: set up the default group, run fn, tear the group down. On an
    exception the error is reported first (`on_error`) and the group is
    aborted, not shut down in order: an orderly shutdown may wait for peers."""
    try:
        dist.init_process_group(backend, timeout=timeout)
        fn(*args)
    except BaseException:
        if on_error is not None:
            on_error(traceback.format_exc())
        _abort_group()
        raise
    dist.destroy_process_group()


def _abort_group() -> None:
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (the error being raised matters, not this one)
        pass


# ----------------------------------------------------------- local ranks


class _Reporter:
    """A rank's line to the launcher: ("handling" | "error" | "done", time, text)."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, kind: str, text: str = "") -> None:
        with self._lock:
            try:
                self._conn.send((kind, time.time(), text))
            except OSError:  # the launcher is gone; nothing left to tell
                pass

    def watch_main_thread(self) -> None:
        """Reports an exception the main thread has been handling for a whole
        watch period (it may never leave a finally block)."""
        main = threading.main_thread().ident
        threading.Thread(target=self._watch, args=(main,), daemon=True,
                         name="sharc-launch-watch").start()

    def _watch(self, main: int) -> None:
        previous = reported = None
        while True:
            time.sleep(_WATCH_PERIOD_S)
            exc = sys._current_exceptions().get(main)
            exc = exc[1] if isinstance(exc, tuple) else exc  # a tuple before Python 3.12
            if exc is not None and exc is previous and exc is not reported:
                self.send("handling", "".join(traceback.format_exception(exc)))
                reported = exc
            elif reported is not None and exc is not reported:
                self.send("handled")  # it was caught and dealt with
                reported = None
            previous = exc


def _local_rank_main(rank: int, world_size: int, port: int, backend: str,
                     timeout: timedelta, fn: Callable, args: tuple, conn) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    reporter = _Reporter(conn)
    reporter.watch_main_thread()
    try:
        _run_rank(backend, timeout, fn, args,
                  on_error=lambda text: reporter.send("error", text))
    except BaseException:  # noqa: BLE001  (reported; the launcher raises it)
        sys.exit(1)
    reporter.send("done")


@dataclass
class _Rank:
    rank: int
    process: mp.process.BaseProcess
    conn: object  # the launcher's end of the rank's pipe; None once closed
    done: bool = False
    error: tuple[float, str] | None = None     # (time, traceback): fn raised
    handling: tuple[float, str] | None = None  # an exception it was handling

    def receive(self) -> None:
        """Reads every message waiting on the pipe."""
        while self.conn is not None and self.conn.poll():
            try:
                kind, when, text = self.conn.recv()
            except (EOFError, OSError):
                self.conn = None
                return
            if kind == "done":
                self.done = True
            elif kind == "error" and self.error is None:
                self.error = (when, text)
            elif kind == "handling":
                self.handling = (when, text)
            elif kind == "handled":
                self.handling = None

    def failed(self) -> bool:
        code = self.process.exitcode
        return self.error is not None or (code is not None and code != 0) or (
            code == 0 and not self.done and self.conn is None)

    def stuck_handling(self, now: float, grace_s: float | None) -> bool:
        """Handling one exception for longer than the grace period."""
        return (grace_s is not None and self.handling is not None
                and now - self.handling[0] > grace_s)

    def running_clean(self) -> bool:
        """Alive, not finished, and handling no exception."""
        return self.process.exitcode is None and not self.done and self.handling is None


class _LocalJob:
    """N local ranks, watched until all succeed or the first one fails."""

    def __init__(self, nproc: int, backend: str, timeout: timedelta,
                 handling_grace_s: float | None) -> None:
        self.nproc = nproc
        self.backend = backend
        self.timeout = timeout
        self.handling_grace_s = handling_grace_s
        self.ranks: list[_Rank] = []

    def run(self, fn: Callable, args: tuple) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        try:
            for r in range(self.nproc):
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_local_rank_main, name=f"sharc-rank-{r}",
                                args=(r, self.nproc, port, self.backend, self.timeout,
                                      fn, args, child))
                p.start()
                child.close()
                self.ranks.append(_Rank(r, p, parent))
            failed = self._wait()
        finally:
            self._stop()
        if failed:
            raise _launch_error(self.ranks, failed)

    def _wait(self) -> list[int]:
        """Blocks until every rank has exited (returns []) or some failed
        (returns those ranks). Ranks that finished but do not exit within
        `_EXIT_GRACE_S` (a non-daemon thread?) are left to `_stop`."""
        finished_at = None
        while True:
            waiting = [r.conn for r in self.ranks if r.conn is not None]
            waiting += [r.process.sentinel for r in self.ranks if r.process.exitcode is None]
            if not waiting:
                return []
            if finished_at is None and all(r.done for r in self.ranks):
                finished_at = time.monotonic()
            if finished_at is not None:
                left = finished_at + _EXIT_GRACE_S - time.monotonic()
                if left <= 0:
                    _warn_not_exiting([r.rank for r in self.ranks if r.process.is_alive()])
                    return []
                multiprocessing.connection.wait(waiting, timeout=left)
            else:  # woken in time to see a rank handling an exception too long
                multiprocessing.connection.wait(waiting, timeout=_WATCH_PERIOD_S * 4)
            for r in self.ranks:
                r.receive()
            failed = [r.rank for r in self.ranks if r.failed()] or self._stuck()
            if failed:
                return self._settle(failed)

    def _stuck(self) -> list[int]:
        """Ranks handling an exception past the grace period while another
        rank runs on without one (see [Note: failing fast])."""
        now = time.time()
        stuck = [r.rank for r in self.ranks if r.stuck_handling(now, self.handling_grace_s)]
        if stuck and any(r.running_clean() for r in self.ranks):
            return stuck
        return []

    def _settle(self, failed: list[int]) -> list[int]:
        """A rank that dies silently makes its peers' collectives fail a moment
        later, and their reports may arrive first: wait briefly for every
        rank's exit or report before deciding who failed first."""
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline:
            alive = [r.process.sentinel for r in self.ranks if r.process.exitcode is None]
            if not alive:
                break
            multiprocessing.connection.wait(alive, timeout=deadline - time.monotonic())
        for r in self.ranks:
            r.receive()
        return [r.rank for r in self.ranks if r.failed()] or self._stuck() or failed

    def _stop(self) -> None:
        for r in self.ranks:
            if r.process.is_alive():
                r.process.kill()
        for r in self.ranks:
            r.process.join(timeout=10)
            r.receive()


def _warn_not_exiting(ranks: list[int]) -> None:
    warnings.warn(f"sharc.launch: ranks {ranks} finished but did not exit within "
                  f"{_EXIT_GRACE_S:.0f}s (a non-daemon thread still running?); they were "
                  "killed", RuntimeWarning, stacklevel=3)


def _exit_reason(r: _Rank) -> str:
    code = r.process.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _launch_error(ranks: list[_Rank], failed: list[int]) -> LaunchError:
    """The first failure in time leads; every rank's report follows. `failed`:
    the ranks seen failing before the job was stopped."""
    reports: dict[int, tuple[float, str, str]] = {}
    for r in ranks:
        if r.error is not None:
            reports[r.rank] = (r.error[0], r.error[1], "raised")
        elif r.handling is not None:
            reports[r.rank] = (r.handling[0], r.handling[1],
                               "raised and was still handling the exception (e.g. in a "
                               "finally block) when the job was stopped")
    failed_exit = [r for r in ranks if r.rank not in reports and r.rank in failed]
    # A rank that died without a word (a crash, os._exit) leads: its peers'
    # reports are then usually only the broken connection to it.
    if reports and not failed_exit:
        first = min(reports, key=lambda k: reports[k][0])
        error = reports[first][1].rstrip().splitlines()[-1]
        lines = [f"sharc.launch: rank {first} failed first ({error}); all {len(ranks)} ranks "
                 "were stopped. Fix the error below (the others may only be its consequences)."]
    else:
        first = failed_exit[0].rank
        lines = [f"sharc.launch: rank {first} {_exit_reason(failed_exit[0])} without "
                 f"reporting an error; all {len(ranks)} ranks were stopped. Its output "
                 "above may say why (a crash, or os._exit in the rank's code)."]
    for k in sorted(reports, key=lambda k: reports[k][0]):
        lines.append(f"--- rank {k} {reports[k][2]}:\n{reports[k][1].rstrip()}")
    for r in failed_exit:
        lines.append(f"--- rank {r.rank} {_exit_reason(r)} without a report")
    return LaunchError("\n".join(lines), first, {k: v[1] for k, v in reports.items()})


def threads_per_rank(world_size: int) -> int:
    """Split this machine's cores evenly between local ranks."""
    return max(1, (os.cpu_count() or 1) // world_size)


def configure_threads(world_size: int) -> None:
    """This rank's share of the cores for its own compute; gloo's worker
    threads get one ([Note: one thread for gloo's threads])."""
    compute_threads.configure(threads_per_rank(world_size))
