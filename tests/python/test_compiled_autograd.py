"""Compiled autograd (torch._dynamo.compiled_autograd) handing backend="sharc"
the backward it traced is refused with an error that names it and the way
out, on every rank alike.

sharc schedules a compiled model's backward itself, in the backward graph
it builds when it compiles the forward; compiled autograd's graph of the
whole backward holds that schedule already. Before, a compiled train step
under torch._dynamo.config.compiled_autograd = True failed with sharc's
"reduced gradient ... is read inside the graph; this is a sharc bug".
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_harness import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = (3, 5, 4)[step % 3]  # the ranks' sizes change by step
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


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

