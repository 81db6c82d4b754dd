"""Compiling each block on its own (FSDP's habit) with the sharc backend.

A graph sharc compiles names the parameters it gathers, so every block is a
cache entry of its own for the one code object the blocks share; with more
blocks than Dynamo's recompile limit (8), the blocks past it used to run
uncompiled. shard() makes room in the limit: every block of a 10-block
model compiles, and training matches eager."""

import torch

from dist_harness import run_ranks
from models import global_batch, rank_slice

BLOCKS = 10


def _model():
    from sharc.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=BLOCKS, n_head=2, n_embd=16))


def _per_block_compile(rank, world):
    import sharc
    from sharc._compile import sharc_backend

    compiled_graphs = []

    def counting_sharc(gm, example_inputs):
        compiled_graphs.append(gm)
        return sharc_backend(gm, example_inputs, {"profile": False})  # compiles faster

    limit_before = torch._dynamo.config.recompile_limit
    out = {}
    for compiled in (False, True):
        model = _model()
        sharc.shard(model)
        if compiled:
            for block in model.blocks:
                block.compile(backend=counting_sharc)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            x, y = global_batch(step, 4)
            logits = model(rank_slice(x, rank, world))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     rank_slice(y, rank, world).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[compiled] = losses
    return out, len(compiled_graphs), limit_before, torch._dynamo.config.recompile_limit


def test_every_block_compiles_and_trains_like_eager():
    for out, graphs, limit_before, limit_after in run_ranks(_per_block_compile, 2):
        assert graphs == BLOCKS, f"{graphs} of {BLOCKS} blocks compiled"
        assert limit_after >= limit_before + BLOCKS > limit_before
        for got, want in zip(out[True], out[False]):
            assert abs(got - want) <= 1e-4 * abs(want), (out[True], out[False])
