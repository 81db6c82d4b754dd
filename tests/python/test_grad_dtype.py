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


# ------------------------------ an fp32 gradient delivered by an autograd.Function

class _Fp32WeightGrad(torch.autograd.Function):
    """x @ w.t() whose backward computes the weight's gradient in fp32 (as
    fused kernels with fp32 accumulators do) and returns it as it is."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.float().t() @ x.float()


class _CustomLinear(nn.Module):
    """A bf16 weight asking for fp32 gradients, read by the autograd.Function
    and by a plain matmul (a bf16 gradient): plain torch casts both to fp32
    and sums them in fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(16, 8).to(torch.bfloat16))
        self.weight.grad_dtype = torch.float32

    def forward(self, x):
        w = self.weight
        return _Fp32WeightGrad.apply(x, w).float().sum() + (x @ w.t()).float().sum()


def _custom_sharded(rank, world, mode):
    import sharc

    model = _CustomLinear()
    sharc.shard(model)
    step = model if mode == "eager" else torch.compile(
        model, backend="sharc", options={"inductor": mode == "compiled"})
    step(_batch(rank)).backward()
    return dict(model.named_parameters())["weight"].grad.clone()  # the shard's


@pytest.mark.parametrize("mode", ["eager", "compiled", "no_inductor"])
def test_fp32_gradient_of_an_autograd_function_is_not_rounded_to_bf16(mode):
    # Data parallel: the mean of each rank's gradient on its own batch, in fp32.
    per_rank = []
    for rank in range(2):
        reference = _CustomLinear()
        reference(_batch(rank)).backward()
        per_rank.append(reference.weight.grad)
    want = (per_rank[0] + per_rank[1]) / 2
    assert want.dtype == torch.float32
    assert not torch.equal(want, want.to(torch.bfloat16).float())  # rounding would show
    for rank, grad in enumerate(run_ranks(_custom_sharded, 2, mode)):
        assert grad.dtype == torch.float32
        assert torch.equal(grad, shard_of(want, rank, 2)), (grad - shard_of(want, rank, 2)).abs().max()
