"""Late reduction waits ([Note: late reduction waits]): a compiled backward
graph on the host leaves its reduce-scatter in flight and the shard
gradients land in .grad at the end of backward (or when too many bytes are
in flight), matching single-process gradients shard by shard, also when
they accumulate over two backwards, with each rank on its own data and
the batch size changing from step to step. Where a
late gradient would be wrong the wait stays in the graph: a gradient hook
or a post-accumulate hook sees the reduced gradient, and autograd.grad
returns it."""

import pytest
import torch

from dist_harness import run_ranks
from models import GraphBreakBlock, shard_of

WORLD = 2


class _Broken(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = torch.nn.ModuleList(GraphBreakBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(self.head(x), y)


def _model(width, depth):
    torch.manual_seed(0)
    return _Broken(width, depth)


def _rows(step):
    """Rows per rank: the batch size changes from step to step."""
    return (4, 6, 3)[step % 3]


def _batch(step, width, rank=None):
    g = torch.Generator().manual_seed(step)
    n = _rows(step)
    x, y = torch.randn(n * WORLD, width, generator=g), torch.randn(n * WORLD, 1, generator=g)
    if rank is None:
        return x, y
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _reference(width, depth, steps, backwards):
    """Per step, the full gradients after `backwards` backwards of the step's
    batch (each rank's loss is the mean over its slice, so the sharded
    average over ranks is the full batch's mean), then an SGD step."""
    model = _model(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        for _ in range(backwards):
            model(*_batch(step, width)).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _sharded(rank, world, width, depth, steps, backwards, hooks):
    import sharc

    model = _model(width, depth)
    sharc.shard(model)
    seen = {}
    p = dict(model.named_parameters())["blocks.0.fc.weight"]  # the shard
    if hooks == "tensor":
        p.register_hook(lambda g: seen.__setitem__("hook", g.clone()))
    elif hooks == "post_accumulate":
        p.register_post_accumulate_grad_hook(lambda t: seen.__setitem__("hook", t.grad.clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend="sharc")
    out = {"grads": [], "late": [], "in_place": [], "hook": []}
    for step in range(steps):
        sharc.reset_memory_stats()
        for _ in range(backwards):
            run(*_batch(step, width, rank)).backward()
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["late"].append(sharc.memory_stats()["late_reductions"])
        out["in_place"].append(sharc.memory_stats()["late_grads_in_place"])
        out["hook"].append(seen.pop("hook", None))
        opt.step()
        opt.zero_grad()
    return out


def _check_grads(results, reference):
    for rank, out in enumerate(results):
        for step, (got, want) in enumerate(zip(out["grads"], reference)):
            for name, full in want.items():
                torch.testing.assert_close(got[name], shard_of(full, rank, WORLD), rtol=1e-5,
                                           atol=1e-6, msg=f"rank {rank} step {step} {name}")


@pytest.mark.parametrize("backwards", [1, 2])
def test_compiled_backward_graphs_leave_reductions_in_flight_and_gradients_match(backwards):
    results = run_ranks(_sharded, WORLD, 16, 4, 3, backwards, None)
    _check_grads(results, _reference(16, 4, 3, backwards))
    for out in results:
        # Every backward graph reduces its block: nothing waits inside a graph.
        assert all(late >= 4 * backwards for late in out["late"]), out["late"]
        # [Note: late gradients written in place]: in the first backward of
        # a step (after zero_grad) each .grad is the zeros its graph
        # returned, so the two shard gradients (weight, bias) of every late
        # block reduction are written into it; in a second backward the
        # zeros were added into the first's .grad, so those are added.
        want = [2 * late // backwards for late in out["late"]]
        assert out["in_place"] == want, (out["in_place"], out["late"])


def test_reductions_past_the_window_are_delivered_during_backward():
    # 512 x 512 blocks: each graph's reduction holds 1.5 MiB or more in
    # flight, so the 4 MiB window delivers the oldest during backward.
    results = run_ranks(_sharded, WORLD, 512, 6, 2, 1, None)
    _check_grads(results, _reference(512, 6, 2, 1))
    for out in results:
        assert all(late >= 6 for late in out["late"]), out["late"]


@pytest.mark.parametrize("hooks", ["tensor", "post_accumulate"])
def test_a_hooked_parameter_sees_its_reduced_gradient(hooks):
    results = run_ranks(_sharded, WORLD, 16, 4, 2, 1, hooks)
    _check_grads(results, _reference(16, 4, 2, 1))
    for rank, out in enumerate(results):
        for step, seen in enumerate(out["hook"]):
            assert seen is not None, "the hook never ran"
            want = out["grads"][step]["blocks.0.fc.weight"]
            torch.testing.assert_close(seen, want, rtol=0, atol=0,
                                       msg=f"rank {rank} step {step}: the hook saw another gradient")
        # The other blocks' reductions still finish late.
        assert all(late >= 3 for late in out["late"]), out["late"]


def _autograd_grad(rank, world):
    import sharc

    model = _model(16, 4)
    sharc.shard(model)
    run = torch.compile(model, backend="sharc")
    params = list(model.parameters())
    sharc.reset_memory_stats()
    grads = torch.autograd.grad(run(*_batch(0, 16, rank)), params)
    late = sharc.memory_stats()["late_reductions"]
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, grads)), late, [p.grad for p in params]


def test_autograd_grad_returns_the_reduced_gradients():
    reference = _reference(16, 4, 1, 1)[0]
    for rank, (grads, late, dot_grads) in enumerate(run_ranks(_autograd_grad, WORLD)):
        assert late == 0
        assert all(g is None for g in dot_grads), "autograd.grad wrote .grad"
        for name, full in reference.items():
            torch.testing.assert_close(grads[name], shard_of(full, rank, WORLD), rtol=1e-5,
                                       atol=1e-6, msg=f"rank {rank} {name}")
