"""Flat ZeRO-3 across simulated hosts (sharc.multihost, docs/multihost.md):
2 network namespaces x 2 ranks, one torchrun agent each, train the same as
4 ranks on one host; and the rig stops every process and removes its
namespaces when a rank dies or the rig is sent SIGTERM.
Skipped, saying why, where namespaces cannot be made (not root, no `ip
netns`)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from models import make_parity_model, train_single
from sharc import multihost
from sharc.multihost import EXIT_NO_NAMESPACES, preflight

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
                PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers():
    # Should a test fail half-way (its rig killed), the next module's tests
    # and runs by hand still find no namespace of the prefix.
    yield
    multihost.remove_namespaces(PREFIX)


def _rig(args, timeout=120):
    # The rig's own --timeout, not the subprocess's: the rig then still
    # removes its namespaces (SIGKILL would leave them).
    cmd = [sys.executable, "-m", "sharc.multihost", "--prefix", PREFIX,
           "--timeout", str(timeout), *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, env=_env())
    return r, time.monotonic() - t0


def _leftovers() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in names.split() if n.startswith(PREFIX + "-")]


def test_flat_zero3_across_two_hosts_equals_one_host(tmp_path):
    _check_two_hosts_equal_one(tmp_path, [])


def test_hybrid_sharding_across_two_hosts_equals_one_host(tmp_path):
    # A (2, 2) mesh on the rig: each host's ranks shard, the hosts replicate;
    # only the gradient all-reduces cross between them.
    _check_two_hosts_equal_one(tmp_path, ["--hybrid"])


@pytest.mark.skipif(os.environ.get("SHARC_MULTIHOST_COMPILED") != "1",
                    reason="compiled across hosts takes about 70 s more here (two compiled "
                           "4-rank jobs); SHARC_MULTIHOST_COMPILED=1 runs it")
def test_compiled_flat_zero3_across_two_hosts_equals_one_host(tmp_path):
    _check_two_hosts_equal_one(tmp_path, ["--compile"])


def _check_two_hosts_equal_one(tmp_path, job_args: list[str]) -> None:
    rig_out, local_out, report = tmp_path / "rig.pt", tmp_path / "local.pt", tmp_path / "r.json"
    r, _ = _rig(["--hosts", "2", "--nproc-per-host", "2", "--report", str(report),
                 "--", JOB, str(rig_out), "--steps", str(STEPS), *job_args], timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    local = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", JOB, str(local_out), "--steps", str(STEPS), *job_args],
        capture_output=True, text=True, timeout=240, env=_env())
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
    if "--hybrid" in job_args:
        # Hybrid: each step all-reduces the trained parameters' gradient
        # shards (half the model per rank, two ranks per host) across.
        trained = make_parity_model()
        param_bytes = sum(p.numel() * p.element_size() for p in trained.parameters()
                          if p.requires_grad)
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


def _job_processes(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a test's own path)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return pids


def test_a_rank_crash_stops_every_host_and_removes_the_namespaces(tmp_path):
    # A stale namespace of the prefix, as a rig killed with SIGKILL leaves:
    # removed before the rig builds its own.
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-h7"], check=True)
    # Rank 1 (host 1) crashes (SIGKILL) while rank 0 sleeps outside any
    # collective, so nothing in torch tells host 0 (when ranks wait in a
    # collective, gloo's closed connections stop them too): host 1's agent
    # fails, host 0 would run on for 10 minutes. The rig stops it after
    # --grace, exits non-zero and leaves no process and no namespace.
    # One rank per host: the rig's work is the same, and the test is quicker.
    out = str(tmp_path / "never.pt")
    r, elapsed = _rig(["--hosts", "2", "--nproc-per-host", "1", "--grace", "2", "--",
                       JOB, out, "--die-rank", "1", "--stall"])
    assert r.returncode not in (0, EXIT_NO_NAMESPACES), r.stderr[-4000:]
    assert "host 1's agent exited with status" in r.stderr, r.stderr[-4000:]
    assert "Signal 9 (SIGKILL) received by PID" in r.stderr, r.stderr[-4000:]
    assert os.path.exists(f"{out}.stalled.0")
    assert elapsed < 60, f"took {elapsed:.0f}s:\n{r.stderr[-4000:]}"
    assert _leftovers() == []
    assert _job_processes(out) == []


def test_sigterm_stops_the_job_and_removes_the_namespaces(tmp_path):
    out = str(tmp_path / "never.pt")
    cmd = [sys.executable, "-m", "sharc.multihost", "--prefix", PREFIX, "--hosts", "2",
           "--nproc-per-host", "1", "--", JOB, out, "--stall"]
    rig = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env())
    try:
        deadline = time.monotonic() + 90
        stalled = [f"{out}.stalled.{k}" for k in range(2)]
        while not all(map(os.path.exists, stalled)) and time.monotonic() < deadline:
            assert rig.poll() is None, rig.communicate()[1][-4000:]
            time.sleep(0.2)
        assert all(map(os.path.exists, stalled)), "the ranks never started"
        t0 = time.monotonic()
        rig.terminate()
        _, err = rig.communicate(timeout=30)
    finally:
        if rig.poll() is None:
            rig.kill()
    assert rig.returncode == 128 + 15, err[-4000:]
    assert time.monotonic() - t0 < 15
    assert _leftovers() == []
    assert _job_processes(out) == []


def test_refuses_where_namespaces_cannot_be_made(monkeypatch):
    # The distinct exit status and message when namespaces cannot be made:
    # here without iproute2 on PATH (the module file itself, which needs
    # neither torch nor sharc's library to say so) ...
    r = subprocess.run([sys.executable, multihost.__file__, "--prefix", PREFIX, "--", JOB, "x"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(_env(), PATH="/nonexistent"))
    assert r.returncode == EXIT_NO_NAMESPACES, r.stderr[-2000:]
    assert "cannot build simulated hosts: 'ip' (iproute2) is not installed" in r.stderr
    # ... and for a user other than root.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "need root" in preflight()
