"""The launcher stops the whole job within seconds when one rank fails, and
raises with the failing rank's traceback (see [Note: failing fast] in
sharc/launch.py). Each job runs as a subprocess under a hard timeout."""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(__file__)
TARGET = os.path.join(HERE, "launch_target.py")
LIMIT_S = 30  # the whole job, two ranks started included


def _run(cmd):
    # sharc as installed (or as PYTHONPATH already says): the source tree
    # alone has no built library.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return r, time.monotonic() - t0


def test_rank_stuck_in_finally_after_raising():
    # Rank 1 never leaves its finally block while rank 0 waits for it in a
    # collective: with the default (5-minute) collective timeout, the job
    # still stops within seconds, naming rank 1's exception first.
    r, elapsed = _run([sys.executable, TARGET, "finally"])
    assert r.returncode != 0
    assert elapsed < LIMIT_S, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "LaunchError: sharc.launch: rank 1 failed first (RuntimeError: boom at step 3 " \
           "on rank 1)" in r.stderr, r.stderr[-3000:]
    assert 'in step3\n    raise RuntimeError(f"boom at step 3' in r.stderr
    assert "still handling the exception" in r.stderr
    assert "job finished" not in r.stdout


def test_ranks_all_handling_an_exception_are_left_to_finish_it():
    # Every rank raised and saves together in its finally block, longer than
    # the grace for a rank handling an exception alone: nobody is stopped
    # before the save, and the job then fails with the exception.
    r, elapsed = _run([sys.executable, TARGET, "save"])
    assert r.returncode != 0
    assert elapsed >= 8, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "saved on rank 0" in r.stdout and "saved on rank 1" in r.stdout, r.stderr[-3000:]
    assert "failed first (RuntimeError: boom at step 3 on rank" in r.stderr, r.stderr[-3000:]


def test_a_rank_recovering_in_its_except_block_is_left_to_recover():
    # Rank 1 backs off 7 s in an except block while rank 0 waits in an
    # all-reduce: shorter than the grace, so the job goes on and finishes.
    r, _ = _run([sys.executable, TARGET, "retry"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "job finished" in r.stdout


def test_rank_kept_alive_after_raising_with_the_default_timeout():
    # The exception left the rank's function: the job stops at once, without
    # waiting for any collective timeout.
    r, elapsed = _run([sys.executable, TARGET, "thread"])
    assert r.returncode != 0
    assert elapsed < LIMIT_S, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "rank 1 failed first (RuntimeError: boom at step 3 on rank 1)" in r.stderr
    assert "--- rank 1 raised:" in r.stderr and "in fail_in_step3" in r.stderr


def test_rank_exiting_without_a_report():
    r, elapsed = _run([sys.executable, TARGET, "exit"])
    assert r.returncode != 0
    assert elapsed < LIMIT_S, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "rank 1 exited with code 3 without reporting an error" in r.stderr, r.stderr[-3000:]


def test_rank_that_finished_but_does_not_exit():
    r, elapsed = _run([sys.executable, TARGET, "linger"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert elapsed < LIMIT_S, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "job finished" in r.stdout
    assert "ranks [1] finished but did not exit within 2s" in r.stderr, r.stderr[-3000:]


def test_under_torchrun_the_collective_timeout_applies():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r, elapsed = _run([torchrun, "--standalone", "--nproc-per-node", "2", TARGET,
                       "finally", "5"])
    assert r.returncode != 0
    assert elapsed < LIMIT_S + 10, f"took {elapsed:.0f}s:\n{r.stderr[-3000:]}"
    assert "Timed out waiting 5000ms" in r.stderr, r.stderr[-3000:]
