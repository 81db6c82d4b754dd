"""Sizes that change from step to step, the way people train: sequence
lengths that vary (and differ between ranks within a step), a batch
dimension marked dynamic, `torch.compile(dynamic=True)` (also over inputs
whose batch equals their length), evaluation at a length never trained
on, an HF causal LM with gradient checkpointing, checkpointed attention,
and two models of one class whose inputs differ in shape. Each is
compared with single-process training, and compiled runs count Dynamo's
graphs: a new size recompiles at most once (into a graph with symbolic
sizes), never once per size.

Every rank sees its own lengths, so the unsharded reference runs each
rank's batch through one model and averages the ranks' losses (what the
sharded gradient average computes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_harness import run_ranks
from models import gathered_beyond_kept
from scenario import in_own_groups

LENGTHS = (16, 24, 40, 8)
# Batch sizes for mark_dynamic: Dynamo specializes a size of 1 whatever is
# marked (a size-1 batch compiles a graph of its own), so none is 1.
BATCHES = (2, 3, 5, 4)
LR = 0.1
VOCAB = 65


def _gpt():
    from sharc.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=2, n_embd=32))


def _llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        # transformers 5 renamed it (the old name warns); both take the
        # checkpoint's keyword arguments first.
        enable = getattr(model, "activation_checkpointing_enable", None) \
            or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    model.train()
    return model


class _HFLoss(nn.Module):
    """An HF causal LM as (tokens, targets) -> loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=y).loss


def _tokens(step: int, rank: int, length: int, batch: int = 2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (batch, length), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _length(step: int, rank: int) -> int:
    """Each rank its own length each step: rank r is r steps ahead."""
    return LENGTHS[(step + rank) % len(LENGTHS)]


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _train_sharded(rank, world, make_model, mode, group, compile_kwargs=None, steps=None,
                   length=_length):
    """Losses per step, graphs compiled after each step, leftover gathered
    bytes after each step, final full parameters."""
    import sharc

    torch._dynamo.reset()
    model = make_model()
    sharc.shard(model, group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    fn = model if mode == "eager" else torch.compile(model, backend="sharc",
                                                     **(compile_kwargs or {}))
    out = {"losses": [], "graphs": [], "left": []}
    graphs_before = _graph_count()
    for step in range(steps or len(LENGTHS)):
        loss = fn(*_tokens(step, rank, length(step, rank)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["graphs"].append(_graph_count() - graphs_before)
        out["left"].append(gathered_beyond_kept(group))
    out["params"] = sharc.full_state_dict(model)
    return out


def _train_reference(make_model, world, steps=None, length=_length):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps or len(LENGTHS)):
        per_rank = [model(*_tokens(step, r, length(step, r))) for r in range(world)]
        loss = sum(per_rank) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_matches(results, reference, rtol=1e-4, atol=1e-5):
    ref_losses, ref_params = reference
    for rank, r in enumerate(results):
        for step, got in enumerate(r["losses"]):
            want = ref_losses[step][rank]
            assert abs(got - want) <= rtol * abs(want) + atol, (rank, step, got, want)
        assert r["left"] == [0] * len(r["left"]), f"rank {rank} left bytes gathered: {r['left']}"
        for name, want in ref_params.items():
            torch.testing.assert_close(r["params"][name], want, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} param {name}: {m}")


def _gpt_runs(rank, world, mode, group):
    return _train_sharded(rank, world, _gpt, mode, group)


def test_gpt_over_lengths_that_change_and_differ_between_ranks():
    runs = run_ranks(in_own_groups, 2, _gpt_runs, [("eager",), ("compiled",)], timeout=900)
    reference = _train_reference(_gpt, 2)
    eager, compiled = (list(r) for r in zip(*runs))
    _assert_matches(eager, reference)
    _assert_matches(compiled, reference)
    for r in compiled:  # the first length, then one graph with symbolic sizes
        assert r["graphs"] == [1, 2, 2, 2], r["graphs"]


class _Encoder(nn.Module):
    """torch's TransformerEncoderLayer between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 12)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


def _encoder():
    torch.manual_seed(0)
    return _Encoder()


# (batch, length) of each rank's input, step by step: a rank whose batch is
# one sample, or one token long, or both (a last partial batch), beside one
# whose is not. Size-1 dimensions compile graphs of their own, in which the
# partitioner may recompute other forward values in backward.
ONES = (((1, 1), (2, 1)), ((2, 3), (1, 1)), ((1, 2), (2, 2)), ((3, 1), (1, 4)), ((1, 1), (1, 1)))


def _ones_loss(fn, step: int, rank: int):
    batch, length = ONES[step][rank]
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 12, (batch, length), generator=g)
    return F.cross_entropy(fn(x).flatten(0, 1), x.flatten())


def _compiled_encoder_runs(steps: int, loss_of):
    """The encoder sharded and compiled, trained `steps` SGD steps on
    `loss_of(fn, step)` -> (loss to differentiate, the value to record):
    recorded losses, gathered bytes left, final full parameters."""
    import sharc

    model = _encoder()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    fn = torch.compile(model, backend="sharc")
    losses = []
    for step in range(steps):
        loss, recorded = loss_of(fn, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(recorded)
    return losses, gathered_beyond_kept(), sharc.full_state_dict(model)


def _assert_nothing_left_and_params_match(results, model):
    """Each rank's (losses, gathered bytes left, full parameters) left
    nothing gathered and ends at the one-process model's parameters."""
    for rank, (_, left, params) in enumerate(results):
        assert left == 0
        for name, want in model.state_dict().items():
            torch.testing.assert_close(params[name], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} param {name}: {m}")


def _size_one_runs(rank, world):
    def loss_of(fn, step):
        loss = _ones_loss(fn, step, rank)
        return loss, loss.item()

    return _compiled_encoder_runs(len(ONES), loss_of)


def test_ranks_with_size_one_inputs_beside_larger_ones_compiled():
    # Before, rank 0's backward for a (1, 1) input gathered the second
    # norm's bias again (its graph recomputed the norm) and rank 1's did not:
    # "the ranks diverged" at the first step.
    results = run_ranks(_size_one_runs, 2, timeout=600)
    model = _encoder()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(len(ONES)):
        per_rank = [_ones_loss(model, step, r) for r in range(2)]
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
        for rank, (losses, _, _) in enumerate(results):
            assert abs(losses[step] - per_rank[rank].item()) <= 1e-4 * abs(losses[step]) + 1e-5
    _assert_nothing_left_and_params_match(results, model)


# Each rank's batch, step by step: a rank left with no rows (a dataset
# split by hand whose last batches run out on one rank) beside one that has
# some. Every rank runs every step, and the loss is each rank's sum over the
# global count of rows (times the world size, which the gradient average
# divides out), so a rank with no rows adds nothing, as in one process.
EMPTY = ((4, 4), (3, 0), (2, 0))


def _empty_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 12, (EMPTY[step][rank], 3), generator=g)


def _empty_runs(rank, world):
    def loss_of(fn, step):
        x = _empty_batch(step, rank)
        loss = F.cross_entropy(fn(x).flatten(0, 1), x.flatten(), reduction="sum")
        loss = loss * world / (sum(EMPTY[step]) * x.size(1))
        return loss, loss.item() / world

    return _compiled_encoder_runs(len(EMPTY), loss_of)


def test_a_rank_with_an_empty_batch_beside_others_compiled():
    # Before, the rank with 0 rows compiled a graph of its own (Dynamo
    # specializes a size of 0), in which Inductor's constant folding had
    # dropped the attention's in_proj_bias: it gathered one parameter fewer
    # than rank 0 and "the ranks diverged" at step 1 ([Note: a rank's empty
    # batch], sharc/_compile/backend.py).
    results = run_ranks(_empty_runs, 2, timeout=600)
    model = _encoder()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(len(EMPTY)):
        x = torch.cat([_empty_batch(step, r) for r in range(2)])
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        got = sum(losses[step] for losses, _, _ in results)
        assert abs(got - loss.item()) <= 1e-4 * abs(got) + 1e-5, (step, got, loss.item())
    _assert_nothing_left_and_params_match(results, model)


def _llama_runs(rank, world, checkpointing, group):
    return _train_sharded(rank, world, lambda: _HFLoss(_llama(checkpointing)), "compiled",
                          group)


def test_hf_causal_lm_compiled_over_lengths_with_checkpointing():
    """HF's own gradient checkpointing (the GPT above covers a model
    without it; the lengths' graphs are the same either way)."""
    runs = run_ranks(in_own_groups, 2, _llama_runs, [(True,)], timeout=1200)
    for checkpointing, results in zip((True,), zip(*runs)):
        _assert_matches(list(results),
                        _train_reference(lambda: _HFLoss(_llama(checkpointing)), 2))
        for r in results:  # no graph compiled once the second length made them dynamic
            assert r["graphs"][1:] == [r["graphs"][1]] * (len(LENGTHS) - 1), \
                (checkpointing, r["graphs"])


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, output_router_logits=True,
                        router_aux_loss_coef=0.1, use_cache=False)
    return _HFLoss(MixtralForCausalLM(cfg))


def _apart_after_one_step(step: int, rank: int) -> int:
    """Both ranks start at one length (one static graph each, alike); then
    rank 0 changes length a step before rank 1 does."""
    return ((12, 9, 16, 9), (12, 12, 7, 13))[rank][step]


def _mixtral_runs(rank, world, group):
    return _train_sharded(rank, world, _mixtral, "compiled", group, {"dynamic": True},
                          steps=4, length=_apart_after_one_step)


def test_hf_moe_compiled_dynamic_over_lengths_that_differ_between_ranks():
    """HF Mixtral (router aux loss on) without gather units, each rank at
    its own length each step. Compiled with Dynamo's automatic dynamic
    shapes, a rank recompiles while the other still runs its first graph,
    and the recompiled frames split at other graph breaks (the new forward
    takes in `lm_head`): the ranks' first all-gathers differ and the
    agreement reports them diverged, naming `dynamic=True`. With it, every
    rank traces the same symbolic graphs from the first step and training
    matches one process."""
    runs = run_ranks(in_own_groups, 2, _mixtral_runs, [()], timeout=1200)
    _assert_matches([r[0] for r in runs],
                    _train_reference(_mixtral, 2, steps=4, length=_apart_after_one_step))


class CheckpointedAttention(nn.Module):
    """Blocks whose attention (F.scaled_dot_product_attention) runs inside a
    torch.utils.checkpoint region."""

    def __init__(self, d: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)
        self.heads = heads

    def _attend(self, i: int, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv[i](x).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out[i](y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x, y):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x)
        for i in range(len(self.qkv)):
            h = h + checkpoint(self._attend, i, h, use_reentrant=False)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _make_checkpointed():
    torch.manual_seed(0)
    return CheckpointedAttention()


def _checkpointed_runs(rank, world, mode, group):
    return _train_sharded(rank, world, _make_checkpointed, mode, group)


def test_checkpointed_attention_over_lengths():
    runs = run_ranks(in_own_groups, 2, _checkpointed_runs, [("eager",), ("compiled",)],
                     timeout=900)
    reference = _train_reference(_make_checkpointed, 2)
    for results in zip(*runs):
        _assert_matches(list(results), reference)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))


def _convnet():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
                         nn.Flatten())


def _inputs_for(kind: str, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "mlp":
        return torch.randn(4, 12, generator=g)
    return torch.randn(2, 3, 9 + 2 * step, 9 + 2 * step, generator=g)


def _two_classmates(rank, world):
    """An nn.Sequential of Linear layers, then one of Conv2d layers (their
    inputs of other ranks and sizes), in one process, both compiled:
    Dynamo's second compile of Sequential.forward is the dynamic one."""
    import sharc

    out = {}
    for kind, make in (("mlp", _mlp), ("conv", _convnet)):
        model = make()
        sharc.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        fn = torch.compile(model, backend="sharc")
        losses = []
        for step in range(3):
            loss = fn(_inputs_for(kind, step, rank)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            assert gathered_beyond_kept() == 0
        out[kind] = (losses, sharc.full_state_dict(model))
    return out


def test_two_models_of_one_class_with_inputs_of_different_shapes():
    results = run_ranks(_two_classmates, 2, timeout=900)
    for kind, make in (("mlp", _mlp), ("conv", _convnet)):
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        want = []
        for step in range(3):
            per_rank = [model(_inputs_for(kind, step, r)).square().mean() for r in range(2)]
            (sum(per_rank) / 2).backward()
            opt.step()
            opt.zero_grad()
            want.append([x.item() for x in per_rank])
        for rank, r in enumerate(results):
            losses, params = r[kind]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want)[:, rank],
                                       rtol=1e-4, atol=1e-6)
            for name, value in model.state_dict().items():
                torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)


def _dynamic_runs(rank, world, how, group):
    """Batch sizes 2, 3, 5, 4 with the batch dimension marked dynamic, or
    lengths with torch.compile(dynamic=True): one graph for all. Then an
    evaluation under no_grad at a length never trained on."""
    import sharc

    torch._dynamo.reset()
    model = _gpt()
    sharc.shard(model, group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    fn = torch.compile(model, backend="sharc", dynamic=True if how == "dynamic" else None)
    out = {"losses": [], "graphs": []}
    graphs_before = _graph_count()
    for step, batch in enumerate(BATCHES):
        length = 16 if how == "mark_dynamic" else _length(step, rank)
        x, y = _tokens(step, rank, length, batch)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["graphs"].append(_graph_count() - graphs_before)
        assert gathered_beyond_kept(group) == 0
    model.eval()
    with torch.no_grad():
        out["eval"] = fn(*_tokens(9, rank, 33, 3)).item()
    out["eval_left"] = gathered_beyond_kept(group)
    return out


def _dynamic_reference(how: str, world: int):
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, batch in enumerate(BATCHES):
        per_rank = [model(*_tokens(step, r, 16 if how == "mark_dynamic" else _length(step, r),
                                   batch)) for r in range(world)]
        (sum(per_rank) / world).backward()
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    model.eval()
    with torch.no_grad():
        evals = [model(*_tokens(9, r, 33, 3)).item() for r in range(world)]
    return losses, evals


def test_mark_dynamic_and_dynamic_true_compile_once_and_evaluate_at_a_new_length():
    hows = ("mark_dynamic", "dynamic")
    runs = run_ranks(in_own_groups, 2, _dynamic_runs, [(h,) for h in hows], timeout=900)
    for how, results in zip(hows, zip(*runs)):
        losses, evals = _dynamic_reference(how, 2)
        for rank, r in enumerate(results):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses)[:, rank],
                                       rtol=1e-4, atol=1e-6, msg=lambda m: f"{how}: {m}")
            assert abs(r["eval"] - evals[rank]) < 1e-4 * abs(evals[rank]), (how, r["eval"])
            assert r["eval_left"] == 0
            # Training: one graph, then the no_grad evaluation: one more.
            assert r["graphs"] == [1, 1, 1, 1], (how, r["graphs"])


class _SquareAttention(nn.Module):
    """Self-attention, then a head over the (batch * length) rows."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        a, _ = self.att(x, x, x, need_weights=False)
        return self.head(a.reshape(b * t, d)).square().mean()


def _square_attention():
    torch.manual_seed(0)
    return _SquareAttention()


# Each step's (batch, length) of each rank: batch equals length, so
# dynamic=True gives both one symbol s, and the weight gradients' sizes come
# out of batch * length = s**2 as expressions like 64*((4*((s**2)//s))//s):
# 256 at every s, but not simplified to it by torch.
SQUARE = (((5, 5), (3, 3)), ((4, 4), (6, 6)), ((7, 7), (4, 4)))


def _square_input(step: int, rank: int):
    batch, length = SQUARE[step][rank]
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(batch, length, 8, generator=g)


def _square_runs(rank, world):
    import sharc

    torch._dynamo.reset()
    model = _square_attention()
    sharc.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    fn = torch.compile(model, backend="sharc", dynamic=True)
    losses, graphs = [], []
    graphs_before = _graph_count()
    for step in range(len(SQUARE)):
        loss = fn(_square_input(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        graphs.append(_graph_count() - graphs_before)
        assert gathered_beyond_kept() == 0
    return losses, graphs, sharc.full_state_dict(model)


def test_dynamic_true_with_batch_equal_to_length():
    # Before, the backward graph failed to compile: "'mm_2' has a symbolic
    # size (64*(((4*(((s77**2)//s77)))//s77))), but a sharded parameter and
    # its gradient have static sizes".
    results = run_ranks(_square_runs, 2, timeout=600)
    model = _square_attention()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(len(SQUARE)):
        per_rank = [model(_square_input(step, r)) for r in range(2)]
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
        for rank, (losses, _, _) in enumerate(results):
            want = per_rank[rank].item()
            assert abs(losses[step] - want) <= 1e-4 * abs(want) + 1e-6, (rank, step, losses)
    for rank, (_, graphs, params) in enumerate(results):
        assert graphs == [1] * len(SQUARE), graphs  # one graph for every square size
        for name, want in model.state_dict().items():
            torch.testing.assert_close(params[name], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} param {name}: {m}")


def test_a_size_constant_in_disguise_is_static_and_a_symbolic_one_is_not():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from sharc._compile.errors import SharcCompileError
    from sharc._compile.sizes import SizeSymbols, static_bytes

    env = ShapeEnv()
    s, t = (env.create_symintnode(env.create_symbol(v, ConstantSource(name),
                                                    dynamic_dim=DimDynamic.DYNAMIC), hint=v)
            for name, v in (("s", 5), ("t", 7)))
    graph = torch.fx.Graph()

    def node(numel):  # a value of 4 * numel bytes, as Dynamo's fake tensors record it
        n = graph.placeholder(f"x{len(graph.nodes)}")
        n.meta["val"] = torch.empty(1).expand(numel)
        return n

    with FakeTensorMode(shape_env=env):
        constant = node(16 * ((4 * ((s * s) // s)) // s))  # 64 at every s
        ceiling = node(-((-(3 * s * t)) // (s * t)))       # 3
        varying = node(4 * ((s * t) // s))                 # 4t
    assert static_bytes(constant) == 256
    assert static_bytes(ceiling) == 12
    with pytest.raises(SharcCompileError, match="symbolic size"):
        static_bytes(varying)
    sizes = SizeSymbols()
    assert sizes.size_of(constant).ir() == "bytes=256"
    assert sizes.size_of(varying).ir().startswith("bytes=112 sym=")
