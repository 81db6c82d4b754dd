"""Eager gradients are reduced asynchronously, a bucket of modules per
collective, and autograd still hands every consumer the reduced gradient:
backward's .grad, autograd.grad, hooks on the shard and after accumulation
(see [Note: eager reduction])."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_harness import run_ranks
from models import global_batch, make_parity_model, rank_slice

WORLD = 2


class Stack(nn.Module):
    """Six linear layers of 32 x 32; `seen` records, while backward runs
    through each layer's input, how many eager reductions are in flight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.seen = []

    def forward(self, x, runtime=None):
        for layer in self.layers:
            if runtime is not None and x.requires_grad:
                x.register_hook(lambda g: self.seen.append(runtime.eager_reductions_in_flight()))
            x = torch.tanh(layer(x))
        return x.square().mean()


def _runtime():
    import torch.distributed as dist

    return torch.classes.sharc.Runtime.for_group(dist.group.WORLD.group_name)


def _reductions(rank, world, bucket_bytes):
    import sharc

    model = Stack()
    config = (sharc.ShardConfig() if bucket_bytes is None
              else sharc.ShardConfig(eager_reduce_bucket_bytes=bucket_bytes))
    sharc.shard(model, config=config)
    runtime = _runtime()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    sharc.reset_memory_stats()
    started = runtime.eager_reductions_started()
    model(x, runtime).backward()
    stats = sharc.memory_stats()
    return (runtime.eager_reductions_started() - started, stats["reduce_scatter_calls"],
            model.seen, runtime.eager_reductions_in_flight())


def test_reductions_overlap_backward_in_buckets_of_modules():
    # A bucket per module (bucket bytes 0): six reductions for twelve
    # parameters, and while backward runs through the earlier layers the
    # later layers' reductions are in flight (a blocking reduction per
    # parameter would leave none).
    for started, calls, seen, left in run_ranks(_reductions, WORLD, 0):
        assert started == calls == 6
        assert max(seen) >= 1, seen
        assert left == 0
    # A layer's gradients are 4224 bytes: at 5000 a bucket closes after its
    # second layer, three collectives.
    for started, calls, seen, left in run_ranks(_reductions, WORLD, 5000):
        assert started == calls == 3
        assert left == 0
    # The default bucket (4 MiB) holds every layer of this small model: one
    # collective in all.
    for started, calls, seen, left in run_ranks(_reductions, WORLD, None):
        assert started == calls == 1
        assert left == 0


def _consumers(rank, world):
    import sharc

    model = make_parity_model()
    # One bucket per module: many reductions, several in flight.
    sharc.shard(model, config=sharc.ShardConfig(eager_reduce_bucket_bytes=0))
    x, y = global_batch(0, 4)
    x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
    params = [p for p in model.parameters() if p.requires_grad]
    # autograd.grad, never touching .grad.
    by_grad = torch.autograd.grad(model(x, y), params)
    assert all(p.grad is None for p in params)
    # backward, with a hook on each shard and one after accumulation.
    hooked, accumulated = {}, {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: hooked.__setitem__(i, g.clone()))
        p.register_post_accumulate_grad_hook(
            lambda q, i=i: accumulated.__setitem__(i, q.grad.clone()))
    model(x, y).backward()
    return ([g.clone() for g in by_grad], [p.grad.clone() for p in params],
            [hooked[i] for i in range(len(params))],
            [accumulated[i] for i in range(len(params))])


def test_every_consumer_of_a_gradient_sees_it_reduced():
    for by_grad, grads, hooked, accumulated in run_ranks(_consumers, WORLD):
        for a, b, c, d in zip(by_grad, grads, hooked, accumulated):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(c, b, rtol=0, atol=0)
            torch.testing.assert_close(d, b, rtol=0, atol=0)


def _reference_grads():
    model = make_parity_model()
    x, y = global_batch(0, 4)
    model(x, y).backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_autograd_grad_matches_single_process():
    from models import shard_of

    ref = _reference_grads()
    for rank, (by_grad, *_rest) in enumerate(run_ranks(_consumers, WORLD)):
        for got, want in zip(by_grad, ref):
            torch.testing.assert_close(got, shard_of(want, rank, WORLD), rtol=1e-5, atol=1e-7)


class Mixed(nn.Module):
    """Layers whose parameters alternate between filling their rows at
    world size 2 (even sizes) and needing padding (odd sizes), so one bucket
    holds runs of both kinds in every order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 5),
                                     nn.Linear(5, 4), nn.Linear(4, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _mixed_batch(rank, poison_rank=None):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    if rank == poison_rank:
        x[0, 0] = float("inf")
    return x


def _mixed_grads(rank, world, bucket_bytes, poison_rank=None):
    import sharc

    model = Mixed()
    sharc.shard(model, config=sharc.ShardConfig(eager_reduce_bucket_bytes=bucket_bytes))
    model(_mixed_batch(rank, poison_rank)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_one_bucket_of_whole_row_and_padded_gradients_matches_single_process():
    # One bucket for the whole model (a bucket size no model here reaches)
    # and a bucket per module: either way every shard gradient is the
    # single-process gradient's shard, padding excluded.
    from models import shard_of

    model = Mixed()
    torch.stack([model(_mixed_batch(r)) for r in range(WORLD)]).mean().backward()
    ref = [p.grad for p in model.parameters()]
    assert {p.numel() % WORLD for p in model.parameters()} == {0, 1}
    for bucket_bytes in (1 << 30, 0):
        for rank, grads in enumerate(run_ranks(_mixed_grads, WORLD, bucket_bytes)):
            for got, want in zip(grads, ref):
                torch.testing.assert_close(got, shard_of(want, rank, WORLD), rtol=1e-6, atol=1e-7)


def test_a_non_finite_gradient_on_one_rank_poisons_every_rank():
    # Rank 1 alone sees an inf: after the one bucketed reduction every rank's
    # every shard gradient is NaN, so a loss scaler decides alike everywhere.
    for rank, grads in enumerate(run_ranks(_mixed_grads, WORLD, 1 << 30, 1)):
        for grad in grads:
            assert torch.isnan(grad).all(), f"rank {rank}: {grad}"
