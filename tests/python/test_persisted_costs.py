"""Measured costs kept across processes (_compile/cost_store.py): a second
process of the same job, with sharc's defaults (profiling on, the budget
from free memory), schedules as the first did, finds every graph in
Inductor's FX graph cache and trains identically; a corrupt or foreign
cost file is measured over, not trusted; ranks take stored collective
costs only when all hold the same ones, and measure together when one
rank lacks them."""

import json
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dist_harness import run_ranks
from models import train_losses

BLOCKS = 2
STEPS = 3
GIB = 1 << 30


def _train(rank, world, cache_dir, free_bytes, probed):
    # One cache directory for both ranks, as on one machine by default.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from torch._dynamo.utils import counters

    import sharc
    from sharc._compile import schedule
    from sharc._compile.profile import COSTS
    from sharc.models.gpt import GPT, GPTConfig

    from sharc._compile import collective_costs

    # What this run would find: free memory a few percent apart from the
    # other run's, and collective costs that bucket the 64-256 KiB
    # parameters differently (2 MB buckets, then 64 KiB).
    schedule.host_free_bytes = lambda: free_bytes
    collective_costs._probe = lambda runtime: probed
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=BLOCKS, n_head=2, n_embd=128))
    sharc.shard(model)
    for block in model.blocks:
        block.compile(backend="sharc")  # the defaults: measured costs, free-memory budget
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_losses(model, opt, STEPS, rank, world)
    full = sharc.full_state_dict(model)
    lookups = {k: counters["inductor"].get(f"fxgraph_cache_{k}", 0) for k in ("hit", "miss")}
    return losses, full, lookups, COSTS.measured, COSTS.loaded


def test_a_second_process_schedules_alike_hits_inductors_cache_and_trains_identically(tmp_path):
    cache_dir = str(tmp_path)
    first = run_ranks(_train, 2, cache_dir, int(11.3 * GIB), [40.0, 2e-5, 60.0, 3e-5],
                      timeout=420)
    for r in first:
        assert r[3] > 0 and r[4] == 0  # measured, nothing stored yet
    # Compiled anew (by rank 0: the others load its graphs, [Note: ranks
    # compile in rank order] in dist_harness.py).
    assert first[0][2]["miss"] > 0
    again = run_ranks(_train, 2, cache_dir, int(10.9 * GIB), [2.0, 1e-2, 3.0, 1e-2],
                      timeout=420)
    for r, before in zip(again, first):
        assert r[3] == 0 and r[4] > 0  # every cost from the first process's file
        assert r[2] == {"hit": before[2]["miss"] + before[2]["hit"], "miss": 0}, r[2]
        assert r[0] == before[0]  # the very same losses
        for name, value in before[1].items():
            assert torch.equal(r[1][name], value), name


def _blocks(x, w):
    for _ in range(2):
        x = torch.relu(x @ w)
    return x.sum()


def _graph():
    return make_fx(_blocks, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8)).graph


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / "sharc"


def _corrupt(directory, prefix):
    (path,) = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    path.write_text('{"valid_for": {"format": 1}, "entr')


def test_compute_costs_are_read_back_and_a_corrupt_file_is_measured_over(cache_dir):
    from sharc._compile.profile import CostCache, profile_compute

    first = CostCache(persist=True)
    costs = profile_compute(_graph(), first)
    assert first.measured > 0

    later = CostCache(persist=True)  # another process's cache
    assert sorted(profile_compute(_graph(), later).values()) == sorted(costs.values())
    assert later.measured == 0 and later.loaded == first.measured

    _corrupt(cache_dir, "compute-")
    after_corruption = CostCache(persist=True)
    assert profile_compute(_graph(), after_corruption)
    assert after_corruption.measured == first.measured and after_corruption.loaded == 0
    assert CostCache(persist=True).get(next(iter(first._costs))) is not None  # rewritten whole


def test_a_cache_in_memory_only_writes_nothing(cache_dir):
    from sharc._compile.profile import CostCache, profile_compute

    profile_compute(_graph(), CostCache())
    assert not cache_dir.exists()


class _Probe:
    """A runtime whose probe returns set costs and counts its calls."""

    def __init__(self, costs):
        self.costs, self.calls = costs, 0

    def collective_costs(self):
        self.calls += 1
        return self.costs


def _agree(costs):
    from sharc._compile import collective_costs

    probe = _Probe(costs)
    collective_costs._AGREED.clear()
    agreed = collective_costs.agreed_collective_costs("g", probe, torch.device("cpu"))
    return agreed, probe.calls


def test_collective_costs_are_read_back_and_a_corrupt_file_is_measured_over(cache_dir):
    measured = [31.5, 0.0021, 47.25, 0.0033]
    assert _agree(measured) == (measured, 1)
    assert _agree([1.0, 1.0, 1.0, 1.0]) == (measured, 0)  # stored: no probe
    _corrupt(cache_dir, "collective-")
    assert _agree([1.0, 1.0, 1.0, 1.0]) == ([1.0, 1.0, 1.0, 1.0], 1)


def test_a_file_of_another_environment_is_ignored(cache_dir):
    from sharc._compile import cost_store

    cost_store.store("collective", {"world_size": 2}, {"costs": [1.0]})
    assert cost_store.load("collective", {"world_size": 2}) == {"costs": [1.0]}
    assert cost_store.load("collective", {"world_size": 4}) is None
    (path,) = cache_dir.iterdir()
    stored = json.loads(path.read_text())
    stored["valid_for"]["torch"] = "0.0"
    path.write_text(json.dumps(stored))
    assert cost_store.load("collective", {"world_size": 2}) is None


def test_ranks_take_stored_collective_costs_only_when_all_hold_the_same():
    from sharc._compile.collective_costs import _common_costs, _digest

    layout = [0, 0]
    under = _digest(str(layout))
    costs = (1.0, 2.0, 3.0, 4.0)
    host = _digest("h")
    assert _common_costs([(host, under, costs)] * 2, layout) == list(costs)
    assert _common_costs([(host, under, costs), (host, float("nan"), None)], layout) is None
    assert _common_costs([(host, under, costs), (host, under, (1.0, 2.0, 3.0, 5.0))],
                         layout) is None
    assert _common_costs([(host, _digest("[0, 1]"), costs)] * 2, layout) is None  # other hosts


def test_the_free_memory_budget_is_rounded_down_to_a_power_of_two():
    from sharc._compile.schedule import _round_budget

    assert _round_budget(2785512960 // 8) == _round_budget(2884214784 // 8) == 1 << 28
    assert _round_budget(1 << 28) == 1 << 28
    assert _round_budget(0) == 0


def _agreed_costs(rank, world, cache_dir, probed):
    # A cache directory per rank: one rank may then have a file the other lacks.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    import torch.distributed as dist

    import sharc
    from sharc._compile import collective_costs
    from sharc.models.gpt import GPT, GPTConfig

    collective_costs._probe = lambda runtime: probed
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16))
    sharc.shard(model)
    model.compile(backend="sharc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_losses(model, opt, 1, rank, world)
    return collective_costs.known_collective_costs(dist.group.WORLD.group_name)


def test_ranks_measure_again_together_when_one_lacks_the_stored_costs(tmp_path):
    stored, fresh = [40.0, 2e-5, 60.0, 3e-5], [2.0, 1e-2, 3.0, 1e-2]
    assert run_ranks(_agreed_costs, 2, str(tmp_path), stored, timeout=420) == [stored] * 2
    assert run_ranks(_agreed_costs, 2, str(tmp_path), fresh, timeout=420) == [stored] * 2
    (lost,) = (tmp_path / "rank1" / "sharc").glob("collective-*.json")
    lost.unlink()
    # Rank 0 still holds the stored costs, rank 1 none: both measure.
    assert run_ranks(_agreed_costs, 2, str(tmp_path), fresh, timeout=420) == [fresh] * 2
