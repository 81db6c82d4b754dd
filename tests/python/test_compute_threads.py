"""A rank's threads: its own compute keeps the count it was given, and gloo's
worker threads start no OpenMP team of their own when they copy a gathered
bucket ([Note: one thread for gloo's threads] in sharc/compute_threads.py).
Counted from the process's thread list, not timed."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from sharc.launch import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the thread list from /proc")


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _name(thread_id: str) -> str:
    with open(f"/proc/self/task/{thread_id}/comm") as f:
        return f.read().strip()


def _threads_started_by_gathers(how, out_dir):
    """One rank in a process of its own, spawned by sharc's launcher as a
    user's ranks are (the main thread has not yet asked torch for its
    thread count): writes its thread count and the threads gloo started."""
    from sharc import compute_threads

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group()  # gloo's worker threads for it start here
    if how == "sharc":
        compute_threads.configure(2)
    else:
        torch.set_num_threads(2)
    if how == "shard":  # a rank not started by sharc: shard() keeps its 2 threads
        import sharc

        torch.manual_seed(0)
        sharc.shard(torch.nn.Linear(8, 8), group)
    shard = torch.randn(1 << 17)  # far above ATen's grain size for one parallel loop
    out = torch.empty(shard.numel() * world)
    dist.barrier(group)
    before = _thread_ids()
    # Several in flight, so that each of gloo's worker threads copies one.
    works = [dist.all_gather_into_tensor(out, shard, group=group, async_op=True)
             for _ in range(4)]
    for work in works:
        work.wait()
    assert torch.equal(out[rank * shard.numel():(rank + 1) * shard.numel()], shard)
    # A new thread takes its creator's name: these were started by gloo's
    # worker threads (the rank's own team, started by the main thread, is not).
    by_gloo = [t for t in _thread_ids() - before if _name(t) == "pt_gloo_runloop"]
    with open(os.path.join(out_dir, str(rank)), "w") as f:
        f.write(f"{torch.get_num_threads()} {len(by_gloo)}")


def _launched(how, tmp_path):
    launch(_threads_started_by_gathers, 2, args=(how, str(tmp_path)))
    return [tuple(map(int, (tmp_path / str(rank)).read_text().split())) for rank in range(2)]


def test_gloo_threads_start_no_team_and_the_rank_keeps_its_threads(tmp_path):
    for threads, started in _launched("sharc", tmp_path):
        assert threads == 2
        assert started == 0, f"{started} threads started by gloo's copies"


def test_shard_keeps_the_ranks_threads_and_gloo_threads_start_no_team(tmp_path):
    for threads, started in _launched("shard", tmp_path):
        assert threads == 2
        assert started == 0, f"{started} threads started by gloo's copies"


def test_without_it_gloo_threads_start_teams_of_the_ranks_size(tmp_path):
    """What the setting avoids, on the torch this project pins: if gloo's
    threads stop starting teams here, torch changed and the note is stale."""
    for threads, started in _launched("torch", tmp_path):
        assert threads == 2
        assert started >= 1


def test_configure_refuses_fewer_than_one_thread():
    from sharc import compute_threads

    with pytest.raises(ValueError, match="at least 1"):
        compute_threads.configure(0)
