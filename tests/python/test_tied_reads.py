"""A parameter installed in several modules (an embedding tied to the
encoder's and the decoder's input and to the output head, as in T5 and
SwitchTransformers) that eager code reads in sibling modules: it is
gathered once a forward pass, not once per module, and training still
matches one unsharded process (see [Note: eager holds])."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import scenario
from dist_harness import run_ranks

VOCAB, WIDTH = 16, 8


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_emb = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.dec_emb = nn.Embedding(VOCAB, WIDTH)
        self.decoder = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.dec_emb.weight = self.enc_emb.weight
        self.head.weight = self.enc_emb.weight

    def forward(self, src, tgt):
        memory = torch.tanh(self.encoder(self.enc_emb(src)))
        h = torch.tanh(self.decoder(self.dec_emb(tgt) + memory))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), tgt.reshape(-1))


def make():
    torch.manual_seed(0)
    return EncoderDecoder()


def batch(step, rank, world):
    """Each rank's own tokens, and a sequence length that changes from
    step to step."""
    g = torch.Generator().manual_seed(100 * step + rank)
    length = 4 + step % 3
    return (torch.randint(0, VOCAB, (2, length), generator=g),
            torch.randint(0, VOCAB, (2, length), generator=g))


def _gathers_of_the_tied_weight(rank, world):
    """How many times each forward pass calls the gather operator on the
    tied weight, and what is left gathered after forward and after a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import sharc

    class CountGathers(TorchDispatchMode):
        def __init__(self, shard):
            super().__init__()
            self.shard, self.calls = shard, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (func is torch.ops.sharc.gather.default
                    and args[0].data_ptr() == self.shard.data_ptr()):
                self.calls += 1
            return func(*args, **(kwargs or {}))

    model = make()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = model.enc_emb._parameters["weight"]  # this rank's shard of the tied weight
    out = {"calls": [], "after_forward": [], "after_step": []}
    for step in range(3):
        mode = CountGathers(shard)
        with mode:
            loss = model(*batch(step, rank, world))
        out["calls"].append(mode.calls)
        out["after_forward"].append(sharc.memory_stats()["gathered_bytes"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["after_step"].append(sharc.memory_stats()["gathered_bytes"])
    return out


def test_a_tied_weight_is_gathered_once_a_forward_pass():
    for out in run_ranks(_gathers_of_the_tied_weight, 2):
        assert out["calls"] == [1, 1, 1], out  # three modules read it each pass
        assert out["after_forward"] == [0, 0, 0], out
        assert out["after_step"] == [0, 0, 0], out


def _rank(rank, world, mode):
    return scenario.run_sharded(rank, world, make, batch, mode, 6)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_training_with_a_tied_weight_matches_single_process(mode):
    reference = scenario.run_reference(make, batch, 2, 6)
    scenario.assert_matches_reference(run_ranks(_rank, 2, mode), reference, 2)
