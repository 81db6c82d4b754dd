"""The runtime owns the eager path's lifetimes ([Note: eager holds]): after
every backward nothing stays gathered (beyond what a compiled schedule
chose to keep), and the runtime's one end-of-backward
callback ran exactly once, whether backward ran over eager code, compiled
graphs or both, and with retain_graph, autograd.grad, no_sync, frozen
parameters, gather units and activation checkpointing (both kinds)."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from dist_harness import run_ranks
from models import gathered_beyond_kept

WORLD = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.a = nn.Linear(4, 8)
        self.b = Block()
        self.c = Block()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        if self.how == "checkpoint":
            h = checkpoint(self.b, h, use_reentrant=False)
            h = checkpoint(self.c, h, use_reentrant=True)
        elif self.how == "compiled":  # one backward over compiled graphs and eager code
            h = _run_eagerly(self.c, self.b(h))
        else:
            h = self.c(self.b(h))
        return self.out(h).pow(2).mean()


@torch.compiler.disable
def _run_eagerly(module, x):
    return module(x)


def _backwards(model, x, how):
    """Runs one step's backward passes the way `how` names; yields after each."""
    import sharc

    if how == "retain_graph":  # two backward passes over one forward
        loss = model(x)
        loss.backward(retain_graph=True)
        yield
        loss.backward()
        yield
    elif how == "autograd_grad":  # the input's gradient only: no gather's backward runs
        x = x.clone().requires_grad_()
        torch.autograd.grad(model(x), [x])
        yield
    elif how == "no_sync":  # two micro-batches held back, then one synced
        for sync in (False, False, True):
            with sharc.no_sync(model, enabled=not sync):
                model(x).backward()
            yield
    else:
        model(x).backward()
        yield


def _after_each_backward(rank, world, how):
    import torch.distributed as dist

    import sharc

    model = Net(how)
    if how == "frozen":
        model.a.weight.requires_grad_(False)
    config = sharc.ShardConfig(gather_units=("b",)) if how == "unit" else sharc.ShardConfig()
    sharc.shard(model, config=config)
    if how == "compiled":
        model = torch.compile(model, backend="sharc")
    runtime = torch.classes.sharc.Runtime.for_group(dist.group.WORLD.group_name)
    pids = range(len(list(model.parameters())))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    seen = []
    for _ in range(2):  # the second step prefetches from the first's order
        ends = runtime.backward_ends()
        for _ in _backwards(model, x, how):
            # What a compiled schedule keeps gathered (selective unsharding) stays.
            states = {runtime.state(p) for p in pids if not runtime.is_persistent(p)}
            seen.append((runtime.backward_ends() - ends, gathered_beyond_kept(), sorted(states)))
            ends = runtime.backward_ends()
    return seen


@pytest.mark.parametrize("how", ["plain", "retain_graph", "autograd_grad", "no_sync", "frozen",
                                 "unit", "checkpoint", "compiled"])
def test_one_end_of_backward_per_backward_and_nothing_left_gathered(how):
    for seen in run_ranks(_after_each_backward, WORLD, how):
        for ends, gathered, states in seen:
            assert ends == 1, seen
            assert gathered == 0, seen
            assert not {"gathered", "gathering"} & {s.lower() for s in states}, seen


def _unit_shards_die_with_the_model(rank, world):
    import gc
    import weakref

    import sharc

    model = Net("unit")
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("b",)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).backward()
    shard = weakref.ref(model.b.lin._parameters["weight"])
    del model
    gc.collect()
    return shard() is None


def test_the_runtime_keeps_no_unit_shard_alive():
    # The runtime outlives models; a unit's parameters (and their grads)
    # go with the model that owns them.
    assert all(run_ranks(_unit_shards_die_with_the_model, WORLD))
