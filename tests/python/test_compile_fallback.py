"""torch.compile with a backend other than sharc's (plain Inductor here) must
not break sharding: parameter reads are captured as sharc's functional
all_gather, whose result is an ordinary value to that backend, so losses and
gradients equal eager and nothing stays gathered (failure mode 1: frames the
sharc compiler does not schedule use the same operations)."""

import torch

from dist_harness import run_ranks
from models import gathered_beyond_kept, global_batch, make_parity_model, rank_slice


def _eager_vs_inductor(rank, world):
    import sharc

    out = {}
    for compiled in (False, True):
        model = make_parity_model()
        sharc.shard(model)
        step = torch.compile(model) if compiled else model
        x, y = global_batch(0, 4)
        losses, gathered = [], []
        for _ in range(2):
            loss = step(rank_slice(x, rank, world), rank_slice(y, rank, world))
            gathered.append(sharc.memory_stats()["gathered_bytes"])
            loss.backward()
            gathered.append(sharc.memory_stats()["gathered_bytes"])
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[compiled] = (losses, gathered, grads)
    return out


def test_inductor_compiled_sharded_model_matches_eager_and_releases():
    for out in run_ranks(_eager_vs_inductor, 2):
        (eager_losses, _, eager_grads) = out[False]
        (losses, gathered, grads) = out[True]
        assert gathered == [0, 0, 0, 0]
        for got, want in zip(losses, eager_losses):
            assert abs(got - want) <= 1e-5 * abs(want)
        assert set(grads) == set(eager_grads)
        for name in grads:
            torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6)


def _graph_break_in_forward(rank, world):
    import sharc
    from sharc.models.gpt import GPT

    class BrokenGPT(GPT):  # a graph break between the embedding and the blocks
        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
            torch._dynamo.graph_break()
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                     targets.reshape(-1))

    out = []
    for compiled in (False, True):
        model = make_parity_model()
        model.__class__ = BrokenGPT
        sharc.shard(model)
        step = torch.compile(model, backend="sharc") if compiled else model
        x, y = global_batch(0, 4)
        losses = []
        for _ in range(2):
            loss = step(rank_slice(x, rank, world), rank_slice(y, rank, world))
            loss.backward()
            losses.append((loss.item(), gathered_beyond_kept()))
        out.append(losses)
    return out


def test_sharc_backend_with_a_graph_break_matches_eager():
    for eager, compiled in run_ranks(_graph_break_in_forward, 2):
        for (want, _), (got, gathered) in zip(eager, compiled):
            assert abs(got - want) <= 1e-5 * abs(want)
            assert gathered == 0
