"""Eager prefetch (ShardConfig.eager_prefetch): from the second step on, each
module's parameters are gathered as one collective, one module ahead, in the
previous step's order. The values are the same gathers' (bitwise equal
losses with prefetch off), fewer collectives run, nothing stays gathered,
and a step that takes another path through the model still trains."""

import torch

from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice


class _SkippingModel(torch.nn.Module):
    """Three layers; `skip` drops the middle one on every rank (a path that
    changes between steps: what was prefetched for it goes unused)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 1)
        self.skip = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if not self.skip:
            h = torch.tanh(self.b(h))
        return self.c(h).pow(2).mean()


def _train(rank, world, prefetch, steps=4):
    import sharc

    model = make_parity_model()
    sharc.shard(model, config=sharc.ShardConfig(eager_prefetch=prefetch))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"losses": [], "calls": [], "peaks": [], "left": []}
    for step in range(steps):
        x, y = global_batch(step, 4 * world)
        sharc.reset_memory_stats()
        loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sharc.memory_stats()
        out["losses"].append(loss.item())
        out["calls"].append(stats["allgather_calls"])
        out["peaks"].append(stats["peak_gathered_bytes"])
        out["left"].append(stats["gathered_bytes"])
    out["params"] = sharc.full_state_dict(model)
    return out


def test_prefetch_is_bitwise_the_same_training_with_fewer_collectives():
    on = run_ranks(_train, 2, True)
    off = run_ranks(_train, 2, False)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        # The first step records the order; it gathers as without prefetch.
        assert a["calls"][0] == b["calls"][0]
        for later_on, later_off in zip(a["calls"][1:], b["calls"][1:]):
            assert later_on < later_off
        assert a["left"] == [0] * len(a["left"])


def _skipping(rank, world):
    import sharc

    torch.manual_seed(0)
    model = _SkippingModel()
    sharc.shard(model)
    b_bytes = sum(p.numel() * p.element_size() for p in model.b.parameters())
    out = {"left": [], "grads_b": []}
    x = torch.randn(4, 8) + rank
    for step in range(4):
        model.skip = step == 2  # step 2 leaves out `b`, which step 1's order prefetches
        sharc.reset_memory_stats()
        model(x).backward()
        stats = sharc.memory_stats()
        out["left"].append(stats["gathered_bytes"])
        shard = dict(model.named_parameters())["b.weight"]  # the shard; `model.b.weight`
        out["grads_b"].append(shard.grad is not None)       # reads a gathered copy
        model.zero_grad()
    out["b_bytes"] = b_bytes
    return out


def test_a_path_change_frees_what_was_prefetched_for_it():
    for out in run_ranks(_skipping, 2):
        assert out["left"] == [0, 0, 0, 0]
        assert out["grads_b"] == [True, True, False, True]


class _Routed(torch.nn.Module):
    """Two experts; each rank's data picks one (a gather unit's inside)."""

    def __init__(self):
        super().__init__()
        self.e0 = torch.nn.Linear(8, 8)
        self.e1 = torch.nn.Linear(8, 8)

    def forward(self, x, expert):
        return (self.e0 if expert == 0 else self.e1)(x)


class _RoutedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.moe = _Routed()
        self.c = torch.nn.Linear(8, 1)

    def forward(self, x, expert):
        return self.c(torch.tanh(self.moe(torch.tanh(self.a(x)), expert))).pow(2).mean()


def _with_unit(rank, world):
    """A gather unit's parameters are never prefetched (its experts run on
    some ranks only, in an order that differs between ranks and steps);
    the rest of the model is, and every rank issues the same collectives."""
    import sharc

    torch.manual_seed(0)
    model = _RoutedModel()
    sharc.shard(model, config=sharc.ShardConfig(gather_units=("moe",)))
    x = torch.randn(4, 8) + rank
    losses = []
    for step in range(4):
        sharc.reset_memory_stats()
        loss = model(x, (rank + step) % 2)
        loss.backward()
        losses.append(loss.item())
        model.zero_grad()
    stats = sharc.memory_stats()
    return losses, stats["gathered_bytes"], stats["allgather_calls"]


def test_gather_units_route_differently_per_rank_with_prefetch_on():
    results = run_ranks(_with_unit, 2, timeout=120)
    for losses, left, _ in results:
        assert len(losses) == 4 and left == 0
    assert results[0][2] == results[1][2]  # the same collectives on both ranks
