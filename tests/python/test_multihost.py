"""Flat ZeRO-3 across simulated hosts (sharc.multihost, docs/multihost.md):
2 network namespaces x 2 ranks, one torchrun agent each, train the same as
4 ranks on one host; and the rig removes its namespaces when a rank dies.
Skipped, saying why, where namespaces cannot be made (not root, no `ip
netns`)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from models import train_single
from sharc.multihost import EXIT_NO_NAMESPACES, Rig, RigConfig, preflight

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "multihost_job.py")
STEPS = 4
PREFIX = "sharcmhtest"  # apart from the default, so a rig run by hand is left alone

_reason = preflight()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"multi-host rig: {_reason}")


def _env() -> dict:
    # The ranks import sharc as this test does (PYTHONPATH as given, plus
    # wherever this sharc came from).
    import sharc

    path = os.path.dirname(os.path.dirname(sharc.__file__))
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]))


def _rig(args, timeout=120):
    cmd = [sys.executable, "-m", "sharc.multihost", "--prefix", PREFIX, *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    return r, time.monotonic() - t0


def _leftovers() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in names.split() if n.startswith(PREFIX + "-")]


def test_flat_zero3_across_two_hosts_equals_one_host(tmp_path):
    rig_out, local_out, report = tmp_path / "rig.pt", tmp_path / "local.pt", tmp_path / "r.json"
    r, _ = _rig(["--hosts", "2", "--nproc-per-host", "2", "--report", str(report),
                 "--", JOB, str(rig_out), "--steps", str(STEPS)])
    assert r.returncode == 0, r.stderr[-4000:]
    local = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", JOB, str(local_out), "--steps", str(STEPS)],
        capture_output=True, text=True, timeout=120, env=_env())
    assert local.returncode == 0, local.stderr[-4000:]
    multi, one = torch.load(rig_out), torch.load(local_out)

    # Where the ranks ran: host 0 holds ranks 0-1, host 1 ranks 2-3, each
    # host a network namespace of its own, neither this test's.
    where = multi["where"]
    assert [w["node_rank"] for w in where] == [0, 0, 1, 1]
    assert where[0]["netns"] == where[1]["netns"] != where[2]["netns"] == where[3]["netns"]
    assert os.readlink("/proc/self/ns/net") not in {w["netns"] for w in where}
    assert len({w["netns"] for w in one["where"]}) == 1

    # The collectives between the hosts crossed their links: each host sent
    # and received at least the parameters' bytes (every step gathers each
    # parameter, half of it from the other host, in forward and backward).
    param_bytes = sum(v.numel() * v.element_size() for v in one["params"].values())
    links = json.loads(report.read_text())["links"]
    for link in links:
        assert link["tx_bytes"] > STEPS * param_bytes, links
        assert link["rx_bytes"] > STEPS * param_bytes, links

    assert multi["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-6)
    assert multi["params"].keys() == one["params"].keys()
    for name, value in one["params"].items():
        torch.testing.assert_close(multi["params"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # And both equal unsharded training on one process.
    losses, state = train_single(STEPS, 8)
    assert multi["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-5)
    for name, value in state.items():
        torch.testing.assert_close(multi["params"][name], value, rtol=1e-4, atol=1e-5)
    assert _leftovers() == []


def test_rank_dying_stops_every_host_and_removes_the_namespaces(tmp_path):
    # A stale namespace of the prefix, as a rig killed with SIGKILL leaves:
    # removed before the rig builds its own.
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-h7"], check=True)
    # Rank 2 (host 1) crashes at step 1 while the others wait for it in a
    # collective: the whole job stops, the rig exits non-zero well within
    # the collective timeout (5 minutes), and nothing of its remains.
    r, elapsed = _rig(["--hosts", "2", "--nproc-per-host", "2", "--",
                       JOB, str(tmp_path / "never.pt"), "--die-rank", "2", "--die-step", "1"])
    assert r.returncode not in (0, EXIT_NO_NAMESPACES), r.stderr[-4000:]
    assert elapsed < 60, f"took {elapsed:.0f}s:\n{r.stderr[-4000:]}"
    assert "SIGKILL" in r.stderr or "Signal 9" in r.stderr, r.stderr[-4000:]
    assert not (tmp_path / "never.pt").exists()
    assert _leftovers() == []


def test_refuses_where_namespaces_cannot_be_made(monkeypatch):
    # The distinct exit status and message when namespaces cannot be made,
    # checked by running as a user who may not make them.
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
         "-m", "sharc.multihost", "--prefix", PREFIX, "--", JOB, "x"],
        capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == EXIT_NO_NAMESPACES, r.stderr[-2000:]
    assert "cannot build simulated hosts: network namespaces need root" in r.stderr
