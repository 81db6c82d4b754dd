"""sharc holds no process group beyond destroy_process_group(), and a
sharded job exits cleanly, every time."""

import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_ranks

HERE = os.path.dirname(__file__)


def _use_after_destroy(rank, world):
    import torch.distributed as dist

    import sharc

    model = torch.nn.Linear(4, 4)
    sharc.shard(model)
    model(torch.ones(1, 4)).sum().backward()
    dist.destroy_process_group()
    errors = []
    for attempt in (lambda: model(torch.ones(1, 4)),
                    lambda: sharc.api.sharded_root(model).group):
        try:
            attempt()
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def test_a_destroyed_group_is_not_kept_alive():
    """If sharc still held the group, the gather would run on it; instead it
    says the group is gone."""
    for errors in run_ranks(_use_after_destroy, 2, init_group=True):
        assert len(errors) == 2
        assert all("has been destroyed" in e for e in errors), errors


@pytest.mark.parametrize("mode,runs", [("eager", 2), ("compiled", 1)])
def test_exit_path_exits_zero_every_time(mode, runs):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for run in range(runs):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "exit_path_job.py"), mode],
                              capture_output=True, text=True, timeout=180, env=env)
        assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
