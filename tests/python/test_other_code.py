"""Shapes of ordinary model code that once crashed or refused to compile,
each trained eager and compiled on 2 gloo ranks against one unsharded
process (SGD, 10 steps): losses, first-step gradients, final parameters,
nothing left gathered, no growth of the per-step peak."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import scenario
from dist_harness import run_ranks

VOCAB, WIDTH = 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TiedBranchy(nn.Module):
    """Tied input/output embeddings and a data-dependent branch inside the
    block loop: Dynamo gives up on the frame and compiles each block alone,
    so the root's own reads run eagerly."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h) if block.fc.bias.sum() > 0 else 0.5 * block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


class CalledTwice(nn.Module):
    """One layer applied twice to the same input, and once more to another."""

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(WIDTH, WIDTH)
        self.l1 = nn.Linear(WIDTH, 3)

    def forward(self, x, _):
        h = self.l0(x) + self.l0(x)
        h = self.l0(torch.relu(h))
        return self.l1(h).pow(2).mean()


class RaisesSometimes(TiedBranchy):
    """Forward raises half-way when asked (after some parameters were read)."""

    explode = False

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = self.blocks[0](h)
        if self.explode:
            raise ValueError("boom")
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def _make(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


def token_batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5),
                                                                          generator=g)


def dense_batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, WIDTH, generator=g), torch.zeros(3)


def step_with_a_failed_forward(step_fn, inputs):
    """Every third step (on every rank alike) first runs a forward that
    raises, as a user whose code failed and retried would."""
    root = getattr(step_fn, "_orig_mod", step_fn)
    root.steps_seen = getattr(root, "steps_seen", -1) + 1
    if isinstance(root, RaisesSometimes) and root.steps_seen % 3 == 1:
        root.explode = True
        try:
            step_fn(*inputs)
        except ValueError:
            pass
        finally:
            root.explode = False
    loss = step_fn(*inputs)
    loss.backward()
    return loss.detach()


SCENARIOS = {
    "tied_branch_in_loop": (_make(TiedBranchy), token_batch),
    "layer_called_twice": (_make(CalledTwice), dense_batch),
    "raise_in_forward": (_make(RaisesSometimes), token_batch),
}


def _rank(rank, world, name, mode, group=None):
    make, batch = SCENARIOS[name]
    return scenario.run_sharded(rank, world, make, batch, mode, 10,
                                train_step=step_with_a_failed_forward, group=group)


@functools.cache
def _runs(mode):
    """Every scenario trained in `mode` in one launch, one after the other,
    each sharded over its own process group: {name: per-rank results}."""
    names = sorted(SCENARIOS)
    runs = run_ranks(scenario.in_own_groups, 2, _rank, [(n, mode) for n in names], timeout=480)
    return {name: [r[i] for r in runs] for i, name in enumerate(names)}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_matches_single_process(name, mode):
    make, batch = SCENARIOS[name]
    reference = scenario.run_reference(make, batch, 2, 10)
    results = _runs(mode)[name]
    scenario.assert_matches_reference(results, reference, 2)
