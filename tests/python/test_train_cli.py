"""The main job starts its own ranks, or runs under torchrun, and trains;
it writes metrics and checkpoints to its run directory, resumes exactly from
a checkpoint, and plots."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

SMALL = ["--steps", "12", "--n-layer", "2", "--n-embd", "48", "--n-head", "2",
         "--seq-len", "32", "--batch-per-rank", "4", "--log-every", "4", "--lr", "3e-3",
         "--warmup-steps", "2", "--eval-every", "8", "--eval-batches", "2",
         "--checkpoint-every", "6", "--sample-chars", "40",
         "--eager"]  # compiling the tiny model would cost more than it saves; see below


def _losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in 12 steps", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def _run(cmd, cwd=None):
    import sharc

    # The sharc this test imported, also from another working directory.
    here = os.path.dirname(os.path.dirname(os.path.abspath(sharc.__file__)))
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def _train(*args, cwd=None):
    return _run([sys.executable, "-m", "sharc.train", "--nproc", "2", *SMALL, *args], cwd=cwd)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The SMALL job (fp32, eager, 2 local ranks) trained once for the tests
    that read it: (the finished process, its run directory). A test that
    changes the directory works on a copy."""
    run = tmp_path_factory.mktemp("small") / "run"
    return _train("--run-dir", str(run)), run


def test_train_starts_local_ranks_and_loss_falls(small_run):
    r, _ = small_run
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert "2 ranks (gloo)" in r.stdout
    m = re.search(r"unsharded ([\d.]+) ([KM])iB, sharded over 2 ranks ([\d.]+) ([KM])iB",
                  r.stdout)
    assert m, r.stdout
    unsharded, sharded = (float(m[i]) * (1024 if m[i + 1] == "M" else 1) for i in (1, 3))
    assert sharded < 0.6 * unsharded  # about half on 2 ranks, plus padding
    assert "sharc: sample:" in r.stdout and "totals over 2 ranks" in r.stdout


def test_init_meta_trains_with_the_default_runs_losses(small_run, tmp_path):
    """--init meta: built on the meta device and initialised into the shards,
    the same initial values as the default build, so the same losses."""
    _, default_run = small_run
    r = _train("--init", "meta", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "built on the meta device and initialised into shards" in r.stdout
    meta, default = _metrics(tmp_path / "run"), _metrics(default_run)
    assert [m["loss"] for m in meta] == [m["loss"] for m in default]
    assert [m.get("val_loss") for m in meta] == [m.get("val_loss") for m in default]
    assert len(meta) == 3


def test_default_run_directory_is_under_runs(tmp_path):
    r = _train("--steps", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = os.listdir(tmp_path / "runs")
    assert _metrics(tmp_path / "runs" / run)[-1]["step"] == 4


def test_train_compiled_with_the_sharc_backend(tmp_path):
    r = _train("--compile", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert ", compiled;" in r.stdout  # --compile after --eager wins


def test_train_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "sharc.train", *SMALL,
              "--run-dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert "2 ranks (gloo)" in r.stdout


def test_metrics_checkpoints_resume_and_plot(small_run, tmp_path):
    r, trained = small_run
    assert r.returncode == 0, r.stderr[-3000:]
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)  # resumed below: a copy of the shared run
    records = _metrics(run)
    assert [m["step"] for m in records] == [4, 8, 12]
    assert [("val_loss" in m) for m in records] == [False, True, True]
    for m in records:
        assert m["tokens_per_s"] > 0 and len(m["memory"]) == 2
        assert {x["rank"] for x in m["memory"]} == {0, 1}
        assert all(x["shard_bytes"] > 0 and x["max_rss_bytes"] > 0 for x in m["memory"])
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step-0000006",
                                                                     "step-0000012"]
    # Resume from step 6 (as if the job had died after it): steps 7..12 again.
    shutil.rmtree(os.path.join(run, "checkpoints", "step-0000012"))
    r = _run([sys.executable, "-m", "sharc.train", "--resume", run, "--plot"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-0000006 at step 6" in r.stdout
    again = _metrics(run)[len(records):]
    assert [m["step"] for m in again] == [8, 12]
    # Bitwise the same training: the validation losses after steps 8 and 12,
    # and the mean training loss of steps 9..12 (step 8's line covers only
    # steps 7..8 after the resume).
    assert [m["val_loss"] for m in again] == [m["val_loss"] for m in records[1:]]
    assert again[-1]["loss"] == records[-1]["loss"]
    assert os.path.getsize(os.path.join(run, "metrics.png")) > 10_000


def test_train_in_bf16_gathers_half_the_bytes(small_run, tmp_path):
    r, fp32_run = small_run  # the same job in fp32
    assert r.returncode == 0, r.stderr[-3000:]
    assert "; fp32; run directory" in r.stdout
    r = _train("--dtype", "bf16", "--run-dir", str(tmp_path / "bf16"))
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert "; bf16 mixed precision (fp32 shards and optimizer state);" in r.stdout
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bf16"
    # The same first 4 steps (the first metrics line of both): every parameter
    # gathered in bf16, half of fp32's bytes, from fp32 shards of the same size.
    fp32, bf16 = _metrics(fp32_run)[0], _metrics(tmp_path / "bf16")[0]
    assert fp32["step"] == bf16["step"] == 4
    for a, b in zip(fp32["memory"], bf16["memory"]):
        assert b["allgather_bytes"] * 2 == a["allgather_bytes"] > 0
        assert b["shard_bytes"] == a["shard_bytes"]


def test_train_in_fp16_scales_the_loss_and_resumes_exactly(tmp_path):
    run = str(tmp_path / "run")
    r = _train("--dtype", "fp16", "--sample-chars", "0", "--run-dir", run)
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = _losses(r.stdout)
    assert last < first - 0.3
    assert re.search(r"fp16 loss scaling: \d+ of 12 steps skipped", r.stdout), r.stdout
    records = _metrics(run)
    assert all(m["loss_scale"] > 0 for m in records)
    # Resume from step 6: the scaler's state comes back with the checkpoint, so
    # steps 7..12 repeat bitwise (a fresh scale would skip a step or scale differently).
    shutil.rmtree(os.path.join(run, "checkpoints", "step-0000012"))
    r = _run([sys.executable, "-m", "sharc.train", "--resume", run])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp16 mixed precision" in r.stdout  # the saved config's dtype
    again = _metrics(run)[len(records):]
    assert [m["val_loss"] for m in again] == [m["val_loss"] for m in records[1:]]
    assert [m["loss_scale"] for m in again] == [m["loss_scale"] for m in records[1:]]
    assert again[-1]["loss"] == records[-1]["loss"]


def test_plot_module_on_a_run_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 5, "loss": 3.0, "memory": [{"rank": 0, "shard_bytes": 2**20}]},
             {"step": 10, "loss": 2.5, "val_loss": 2.6,
              "memory": [{"rank": 0, "shard_bytes": 2**20}]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = _run([sys.executable, "-m", "sharc.plot", str(run), "--out", str(tmp_path / "p.png")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_train_rejects_bad_arguments():
    r = _run([sys.executable, "-m", "sharc.train", "--steps", "0"])
    assert r.returncode != 0
    assert "--steps must be at least 1" in r.stderr
    r = _run([sys.executable, "-m", "sharc.train", "--resume", "/nonexistent/run"])
    assert r.returncode != 0
    assert "is not a run directory" in r.stderr
    r = _run([sys.executable, "-m", "sharc.train", "--dtype", "fp8"])
    assert r.returncode != 0
    assert "--dtype must be one of fp32, bf16, fp16, got 'fp8'" in r.stderr
