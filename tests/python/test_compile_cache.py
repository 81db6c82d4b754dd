"""Inductor's FX graph cache with the sharc backend ([Note: sharc and
Inductor's caches] in sharc/_compile/backend.py).

A later process that schedules its graphs as an earlier one did finds them
in the earlier one's cache directory, and trains exactly as the process
that compiled them: the same losses, the same final parameters, the same
collectives. A graph that gathers other parameters does not hit: the
blocks of a model, compiled one by one, are identical but for their
parameters' ids, and none finds another's entry; nor does the same model
sharded over another process group.

The schedule is made deterministic (profiling off, a set memory budget):
with measured costs, a later process may schedule differently, and then
misses, which is correct too."""

import os

import torch

from dist_harness import run_ranks
from models import train_losses

BLOCKS = 2
STEPS = 3
OPTIONS = {"profile": False, "memory_budget_bytes": 1 << 20}


def _train(rank, world, cache_dir, other_group):
    # Each rank a directory of its own: otherwise a rank could hit what the
    # other rank wrote a moment before, and the counts below would race.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import sharc
    from sharc.models.gpt import GPT, GPTConfig

    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=BLOCKS, n_head=2, n_embd=16))
    group = dist.new_group() if other_group else None
    sharc.shard(model, group)
    for block in model.blocks:  # identical blocks, each its own graphs
        block.compile(backend="sharc", options=OPTIONS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_losses(model, opt, STEPS, rank, world)
    stats = sharc.memory_stats(group)
    full = sharc.full_state_dict(model)
    cache = {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items()
             if k.startswith("fxgraph_cache_")}
    return losses, full, stats["allgather_calls"], cache


def _lookups(result) -> dict:
    cache = result[3]
    return {k: cache.get(k, 0) for k in ("hit", "miss", "bypass")}


def test_a_cache_hit_trains_identically_and_other_layouts_do_not_hit(tmp_path):
    cache_dir = str(tmp_path)
    graphs = 2 * BLOCKS  # a forward and a backward graph per block
    first = run_ranks(_train, 2, cache_dir, False, timeout=420)
    for r in first:
        # The second block's graphs differ from the first's in parameter ids only.
        assert _lookups(r) == {"hit": 0, "miss": graphs, "bypass": 0}, _lookups(r)
        assert r[2] > 0  # the compiled graphs gather

    again = run_ranks(_train, 2, cache_dir, False, timeout=420)
    for r, before in zip(again, first):
        assert _lookups(r) == {"hit": graphs, "miss": 0, "bypass": 0}, _lookups(r)
        assert r[0] == before[0]  # the very same losses
        assert r[2] == before[2]  # the same collectives
        for name, value in before[1].items():
            assert torch.equal(r[1][name], value), name

    elsewhere = run_ranks(_train, 2, cache_dir, True, timeout=420)
    for r, before in zip(elsewhere, first):
        assert _lookups(r) == {"hit": 0, "miss": graphs, "bypass": 0}, _lookups(r)
        assert r[0] == before[0]  # the same arithmetic, compiled anew


# -- a backward that keeps its graph ----------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _mlp_batch(rank):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(7 + rank))


def _backwards(out, retain):
    """Two losses' backward passes over one forward, the first keeping the
    graph (retain), or their sum's backward."""
    losses = (out.pow(2).mean(), out.abs().mean())
    if not retain:
        sum(losses).backward()
        return
    for i, loss in enumerate(losses):
        loss.backward(retain_graph=i < len(losses) - 1)


def _mlp_grads(rank, world, cache_dir, retain):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    from torch._dynamo.utils import counters

    import sharc

    counters.clear()
    model = _mlp()
    sharc.shard(model)
    step = torch.compile(model, backend="sharc", options=OPTIONS)
    _backwards(step(_mlp_batch(rank)), retain)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items()
                   if k.startswith("fxgraph_cache_")}


def test_a_backward_that_keeps_its_graph_never_runs_code_compiled_for_one_that_did_not(
        tmp_path):
    """[Note: a backward graph's donated buffers] in sharc/_compile/backend.py:
    a graph whose backward was compiled by a backward that let go of its
    saved tensors writes results over them; a later process whose backward
    keeps the graph must not find that code in the cache."""
    from models import shard_of

    cache_dir = str(tmp_path)
    run_ranks(_mlp_grads, 2, cache_dir, False)  # compiles and stores both graphs
    kept = run_ranks(_mlp_grads, 2, cache_dir, True)
    ref = _mlp()
    _backwards(ref(torch.cat([_mlp_batch(r) for r in range(2)])), True)
    for rank, (grads, cache) in enumerate(kept):
        assert cache.get("hit", 0) >= 1, cache  # the forward graph: the same key
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], shard_of(p.grad, rank, 2), rtol=1e-5,
                                       atol=1e-7, msg=lambda m: f"rank {rank} {name}: {m}")



class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.one = torch.nn.Linear(6, 1)  # 6 weights: shards of 3 on 2 ranks, of 2 on 3

    def forward(self, x):
        return self.fc(x) + self.one(x)


def _two_heads_grads(rank, world, cache_dir):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    from torch._dynamo.utils import counters

    import sharc

    counters.clear()
    torch.manual_seed(0)
    model = _TwoHeads()
    sharc.shard(model)
    step = torch.compile(model, backend="sharc")  # the default options
    step(_mlp_batch(rank)).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items()
                   if k.startswith("fxgraph_cache_")}


def test_a_graph_compiled_for_another_world_size_is_not_reused(tmp_path):
    """[Note: a graph's shard sizes] in sharc/_compile/backend.py: a backward
    graph whose parameters stayed gathered from forward takes no shard, so
    its inputs are the same on 3 ranks and on 2, but the shard gradients it
    returns are not; a 2-rank job after a 3-rank one in the same cache must
    compile its own."""
    from models import shard_of

    cache_dir = str(tmp_path)
    run_ranks(_two_heads_grads, 3, cache_dir)  # stores the 3-rank graphs
    two = run_ranks(_two_heads_grads, 2, cache_dir)
    torch.manual_seed(0)
    ref = _TwoHeads()
    ref(torch.cat([_mlp_batch(r) for r in range(2)])).pow(2).mean().backward()
    for rank, (grads, cache) in enumerate(two):
        assert cache.get("hit", 0) == 0, cache
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], shard_of(p.grad, rank, 2), rtol=1e-5,
                                       atol=1e-7, msg=lambda m: f"rank {rank} {name}: {m}")
