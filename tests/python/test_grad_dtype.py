"""A parameter's grad_dtype survives shard(): a bf16 weight that asks for
fp32 gradients gets them reduced and accumulated in fp32, eager and compiled."""

import pytest
import torch
import torch.nn as nn

from dist_harness import run_ranks
from models import shard_of


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    model[0].weight.grad_dtype = torch.float32
    return model


def _batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 8, generator=g).to(torch.bfloat16)


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _sharded(rank, world, mode):
    import sharc

    model = _make()
    sharc.shard(model)
    step = torch.compile(model, backend="sharc") if mode == "compiled" else model
    for _ in range(2):  # accumulates over two backward passes
        _loss(step, _batch(rank)).backward()
    return {n: (p.grad_dtype, p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_grad_dtype_kept_and_reduced_in_it(mode):
    reference = _make()
    x = torch.cat([_batch(0), _batch(1)])
    for _ in range(2):
        _loss(reference, x).backward()
    for rank, grads in enumerate(run_ranks(_sharded, 2, mode)):
        for name, p in reference.named_parameters():
            grad_dtype, grad = grads[name]
            assert grad_dtype == p.grad_dtype and grad.dtype == p.grad.dtype, name
            torch.testing.assert_close(grad.float(), shard_of(p.grad, rank, 2).float(),
                                       rtol=2e-2, atol=2e-2)
    assert reference[0].weight.grad.dtype == torch.float32
    assert reference[2].weight.grad.dtype == torch.bfloat16
