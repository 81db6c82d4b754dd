"""Compiling each block on its own (FSDP's habit) with the sharc backend.

A graph sharc compiles names the parameters it gathers, so every block is a
cache entry of its own for the one code object the blocks share; with more
blocks than Dynamo's recompile limit (8), the blocks past it used to run
uncompiled. shard() makes room in the limit: every block of a 10-block
model compiles, and training matches eager."""

import gc

import torch

from dist_harness import run_ranks
from models import train_losses

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

    out = {}
    for compiled in (False, True):
        model = _model()
        sharc.shard(model)
        if compiled:
            for block in model.blocks:
                block.compile(backend=counting_sharc)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out[compiled] = train_losses(model, opt, 2, rank, world)
    return out, len(compiled_graphs)


def test_every_block_compiles_and_trains_like_eager():
    for out, graphs in run_ranks(_per_block_compile, 2):
        assert graphs == BLOCKS, f"{graphs} of {BLOCKS} blocks compiled"
        for got, want in zip(out[True], out[False]):
            assert abs(got - want) <= 1e-4 * abs(want), (out[True], out[False])


def test_the_room_counts_live_callable_modules_sharing_a_forward():
    import torch._dynamo.config as dynamo_config

    from sharc._compile.recompile_room import RecompileRoom

    saved = dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit
    try:
        dynamo_config.recompile_limit = 8
        room = RecompileRoom()
        layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(12))
        room.add(torch.nn.Sequential(*layers))  # 12 Linear; the containers are not counted
        assert dynamo_config.recompile_limit == 12 + 8
        del layers
        kept = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        room.add(kept)
        assert dynamo_config.recompile_limit == 12 + 8  # never lowered
        dynamo_config.recompile_limit = 8
        gc.collect()
        one_more = torch.nn.Linear(2, 2)
        room.add(one_more)  # the first 12 are gone: 3 live Linear
        assert dynamo_config.recompile_limit == 3 + 8
        assert len(kept) == 2 and one_more is not None
    finally:
        dynamo_config.recompile_limit, dynamo_config.accumulated_recompile_limit = saved
