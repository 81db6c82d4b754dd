"""Compiled autograd (torch._dynamo.compiled_autograd) over a sharded model is
refused with an error that names it and the way out, on every rank alike.

sharc schedules a sharded model's backward itself: eager, from hooks on
its gathers and saved tensors; compiled, in the backward graph it builds
when it compiles the forward (compiled autograd's graph of the whole
backward holds that schedule already). Before, an eager backward under it
failed with torch's "compiled_args nyi ... DropBackwardHold", and a
compiled train step under torch._dynamo.config.compiled_autograd = True
with sharc's "reduced gradient ... is read inside the graph; this is a
sharc bug".
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_harness import run_ranks

LR = 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = (3, 5, 4)[step % 3]  # the ranks' sizes change by step
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _eager_backward_refused_then_run_plain(rank, world):
    """Each step's backward tried under compiled autograd (refused), then
    run plain on the same graph; returns the refusals and the final full
    parameters."""
    import sharc
    from torch._dynamo import compiled_autograd

    model = _model()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    refusals = []
    for step in range(3):
        x, y = _batch(step, rank)
        loss = F.mse_loss(model(x), y)
        try:
            with compiled_autograd._enable(torch.compile(backend="inductor")):
                loss.backward(retain_graph=True)
        except NotImplementedError as e:
            refusals.append(str(e))
        else:
            refusals.append(None)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return refusals, dict(sharc.full_state_dict(model))


def test_an_eager_backward_under_compiled_autograd_is_refused_clearly():
    results = run_ranks(_eager_backward_refused_then_run_plain, 2, timeout=300)
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(3):
        parts = [_batch(step, r) for r in range(2)]
        F.mse_loss(reference(torch.cat([p[0] for p in parts])),
                   torch.cat([p[1] for p in parts])).backward()
        opt.step()
        opt.zero_grad()
    for refusals, params in results:
        assert all(r is not None and "sharc: compiled autograd" in r and
                   'torch.compile(model, backend="sharc")' in r for r in refusals), refusals
        # The refusal comes before the backward runs: the plain one after it
        # trains as one process does.
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(params[name], want, rtol=1e-4, atol=1e-5)


def _compiled_step_under_compiled_autograd(rank, world):
    import torch._dynamo

    import sharc

    model = _model()
    sharc.shard(model)
    saved = torch._dynamo.config.compiled_autograd
    # Read when torch.compile wraps the function, not when it runs.
    torch._dynamo.config.compiled_autograd = True
    try:
        @torch.compile(backend="sharc")
        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss.detach()

        train_step(*_batch(0, rank))
    except Exception as e:  # Dynamo's BackendCompilerFailed around sharc's error
        return str(e)
    finally:
        torch._dynamo.config.compiled_autograd = saved
    return None


def test_a_compiled_train_step_under_compiled_autograd_is_refused_clearly():
    """The whole step (forward, loss, backward) compiled with sharc while
    torch._dynamo.config.compiled_autograd is on: compiled autograd hands
    the backward it traced to the same backend."""
    for message in run_ranks(_compiled_step_under_compiled_autograd, 2, timeout=300):
        assert message is not None and "sharc: compiled autograd" in message, message
        assert "leave compiled autograd off" in message, message
        assert "sharc bug" not in message, message

