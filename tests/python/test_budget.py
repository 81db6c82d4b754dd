"""Profile-guided scheduling under a memory budget (CompileConfig): the
runtime's peak of gathered bytes never exceeds the budget the schedule was
built for; a budget no schedule fits is refused naming the smallest one;
selective unsharding saves exactly the kept parameters' backward
all-gathers; profiling changes no result; and training matches with every
choice the scheduler makes."""

import functools
import re

import pytest
import torch

from dist_harness import RankFailure, run_ranks
from models import global_batch, make_optimizer, make_parity_model, rank_slice
from scenario import in_own_groups


def _blocks(n_layer):
    from sharc.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=n_layer, n_head=4, n_embd=64))


def _four_blocks():
    """825 KB of parameters, compiled in half the time of eight blocks;
    enough where a budget of a few blocks' parameters must keep some of
    them gathered and not others (measured: 400 KB kept 15 of its 52
    parameters, 250 KB 13; eight blocks kept 26 and 21 of 100). Even the
    largest budget of TIMES (six times the smallest, 83 KB) is below them,
    so every budget tested limits what the schedule keeps."""
    return _blocks(4)


def _peaks(rank, world, options, group=None):
    import sharc

    model = _four_blocks()
    sharc.shard(model, group)
    step = torch.compile(model, backend="sharc", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(65, (2, 32), generator=torch.Generator().manual_seed(rank))
    peaks, losses = [], []
    for _ in range(3):
        sharc.reset_memory_stats(group)
        loss = step(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        peaks.append(sharc.memory_stats(group)["peak_gathered_bytes"])
        losses.append(loss.item())
    return peaks, losses


@functools.cache
def _smallest_budget() -> int:
    """The 4-block model's smallest feasible budget, as the refusal of a
    1-byte budget names it."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_peaks, 2, {"memory_budget_bytes": 1}, timeout=420)
    message = str(failure.value)
    assert "memory_budget_bytes=1 is below the smallest budget this graph can run in" in message
    return int(re.search(r"raise memory_budget_bytes to at least (\d+)", message).group(1))


def test_a_budget_below_the_smallest_feasible_one_names_it():
    smallest = _smallest_budget()
    # At least the largest parameter with its bias (an MLP weight, 64 x 256
    # floats, and 256 floats), at most a few of the largest.
    assert 66_560 <= smallest <= 4 * 66_560
    with pytest.raises(RankFailure, match=f"raise memory_budget_bytes to at least {smallest}"):
        run_ranks(_peaks, 2, {"memory_budget_bytes": smallest - 1}, timeout=420)


TIMES = (1, 3, 6)


@functools.cache
def _budget_runs():
    """Each budget of TIMES x the smallest: one launch, a fresh model
    compiled for each budget; {times: (budget, per-rank (peaks, losses))}."""
    budgets = [times * _smallest_budget() for times in TIMES]
    runs = run_ranks(in_own_groups, 2, _peaks,
                     [({"memory_budget_bytes": b},) for b in budgets], timeout=600)
    return {times: (budget, [r[i] for r in runs])
            for i, (times, budget) in enumerate(zip(TIMES, budgets))}


@pytest.mark.parametrize("times", TIMES)
def test_the_budget_is_never_exceeded(times):
    budget, results = _budget_runs()[times]
    assert budget == times * _smallest_budget()
    for peaks, losses in results:
        assert max(peaks) <= budget, peaks
        assert all(torch.isfinite(torch.tensor(losses)))


def _backward_gathers(rank, world, profile, group=None):
    """All-gather bytes sent during backward, per step, and the kept bytes."""
    import sharc
    from sharc.api import sharded_root

    model = _four_blocks()
    sharc.shard(model, group)
    step = torch.compile(model, backend="sharc", options={"profile": profile,
                                                         "memory_budget_bytes": 400_000})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(65, (2, 32), generator=torch.Generator().manual_seed(rank))
    sent = []
    for _ in range(2):
        loss = step(x, x)
        sharc.reset_memory_stats(group)
        loss.backward()
        sent.append(sharc.memory_stats(group)["allgather_bytes"])
        opt.step()
        opt.zero_grad()
    kept = dict(sharded_root(model).runtime.persistent_params())
    return sent, kept


def test_selective_unsharding_saves_exactly_the_kept_parameters_backward_gathers():
    # Both runs in one launch, each model on its own group.
    runs = run_ranks(in_own_groups, 2, _backward_gathers, [(True,), (False,)], timeout=600)
    for (sent_kept, kept), (sent_plain, none_kept) in runs:
        assert kept and not none_kept
        # Each rank sends its shard, half the padded full bytes, per gather.
        saved = sum(full // 2 for full in kept.values())
        for with_keep, without in zip(sent_kept, sent_plain):
            assert without - with_keep == saved


def _train(rank, world, options, four_blocks, group=None, steps=3):
    import sharc

    model = _four_blocks() if four_blocks else make_parity_model()
    sharc.shard(model, group)
    step_fn = model if options is None else torch.compile(model, backend="sharc",
                                                          options=options)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 2 * world, seq=16)
        loss = step_fn(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, sharc.full_state_dict(model)


@functools.cache
def _eager_training(four_blocks: bool):
    """The eager run every compiled choice is compared with, run once."""
    return run_ranks(_train, 2, None, four_blocks)


CHOICES = {  # name: (options, four_blocks)
    "default": ({}, False),  # measured: kept parameters, auto buckets
    "keep-all": ({"memory_budget_bytes": 10**9}, False),  # room to keep everything
    "tightest": ({"memory_budget_bytes": 250_000}, True),  # tight: little kept, small buckets
    "unprofiled": ({"profile": False}, False),  # unmeasured: nothing kept, 64 KiB buckets
}


@functools.cache
def _compiled_training(four_blocks: bool):
    """Every choice on that model compiled and trained in one launch, each a
    fresh model on its own process group: {choice: per-rank results}."""
    names = [n for n, (_, four) in CHOICES.items() if four == four_blocks]
    runs = run_ranks(in_own_groups, 2, _train,
                     [(CHOICES[n][0], four_blocks) for n in names], timeout=600)
    return {name: [r[i] for r in runs] for i, name in enumerate(names)}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_every_scheduling_choice_trains_like_eager(choice):
    _, four_blocks = CHOICES[choice]
    eager = _eager_training(four_blocks)
    compiled = _compiled_training(four_blocks)[choice]
    for (losses_c, state_c), (losses_e, state_e) in zip(compiled, eager):
        assert losses_c == pytest.approx(losses_e, rel=1e-5)
        for name, value in state_e.items():  # atol: as test_compiled_parity.py
            torch.testing.assert_close(state_c[name], value, rtol=1e-4, atol=1e-4)


def _profiled_losses(rank, world, profile, group=None):
    import sharc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    sharc.shard(model, group)
    step = torch.compile(model, backend="sharc", options={"profile": profile})
    torch.manual_seed(1 + rank)  # dropout masks: profiling must not draw from this stream
    losses = []
    for i in range(3):
        loss = step(torch.ones(4, 16) * (i + 1)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_profiling_changes_no_result():
    # One launch, each model on its own group; both runs seed alike before
    # their first step (which compiles).
    runs = run_ranks(in_own_groups, 2, _profiled_losses, [(True,), (False,)], timeout=420)
    profiled, plain = ([r[i] for r in runs] for i in range(2))
    assert profiled == plain  # bitwise: the same dropout masks, the same sums


def _dumped(rank, world, directory):
    import sharc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    sharc.shard(model)
    step = torch.compile(model, backend="sharc", options={"dump_ir": directory})
    step(torch.ones(4, 16)).sum().backward()
    return sorted(open(f"{directory}/{n}").read() for n in __import__("os").listdir(directory)
                  if n.startswith(f"rank{rank}_") and n.endswith(".after.ir"))


def _without_compute_costs(irs: list[str]) -> list[str]:
    return [re.sub(r'(compute "[^"]*".*?) cost=\S+', r"\1", ir) for ir in irs]


def test_measured_costs_are_in_the_ir_and_the_schedule_the_same_on_every_rank(tmp_path):
    first, second = run_ranks(_dumped, 2, str(tmp_path))
    # Compute costs are each rank's own measurements; everything that
    # decides collectives (the collective costs included) is agreed.
    assert _without_compute_costs(first) == _without_compute_costs(second)
    forward = next(t for t in first if "reduce_scatter" not in t)
    assert 'compute "aten.mm.default"' in forward or 'compute "aten.addmm.default"' in forward
    assert any(" cost=" in line for line in forward.splitlines() if "compute" in line)
    assert any(" cost=" in line for line in forward.splitlines() if " gather @" in line)
