"""The main job starts its own ranks, or runs under torchrun, and trains."""

import os
import re
import subprocess
import sys

SMALL = ["--steps", "12", "--n-layer", "2", "--n-embd", "48", "--n-head", "2",
         "--seq-len", "32", "--batch-per-rank", "4", "--log-every", "4", "--lr", "3e-3"]


def _losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in 12 steps", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def test_train_starts_local_ranks_and_loss_falls():
    r = _run([sys.executable, "-m", "sharc.train", "--nproc", "2", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert "2 ranks (gloo)" in r.stdout


def test_train_compiled_with_the_sharc_backend():
    r = _run([sys.executable, "-m", "sharc.train", "--nproc", "2", "--compile", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3


def test_train_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "sharc.train", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert "2 ranks (gloo)" in r.stdout


def test_train_rejects_bad_arguments():
    r = _run([sys.executable, "-m", "sharc.train", "--steps", "0"])
    assert r.returncode != 0
    assert "--steps must be at least 1" in r.stderr
