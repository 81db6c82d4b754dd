"""Stock torch.nn building blocks that reach their parameters in their own
ways, trained eager and compiled on 2 gloo ranks against one unsharded
process (SGD, 3 steps; see scenario.py): recurrent layers (which cache
their weights in `_flat_weights`; one fed packed sequences of lengths
that differ between ranks), attention (`in_proj_weight` read by a
functional), a transformer encoder, activation checkpointing both ways
(recomputing a forward inside backward: a second set of gathers and saved
tensors that must match the first) and selective, a parametrized weight (weight_norm's
`original0`/`original1`), a convolution, a bilinear layer, an embedding
with a padding index and one with sparse gradients, embedding bags with
sparse gradients."""

import functools
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import scenario
from dist_harness import run_ranks

WIDTH = 8


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.gru = nn.GRU(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return F.mse_loss(self.head(h[:, -1]).squeeze(-1), y)


class PackedRecurrent(nn.Module):
    """A 2-layer LSTM fed packed sequences whose lengths come from the data:
    a rank whose lengths are all equal gets another backward graph (it
    saves and unpacks the weights in another order, and saves the first
    layer's weight_ih where unequal lengths do not), which once parted the
    ranks' backward gathers."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        # With batch(): rank 0's lengths differ and rank 1's are equal at step 0.
        lengths = torch.where(x[:, 0, 3] > 0, 5, 3)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return F.mse_loss(self.head(h.sum(1)).squeeze(-1), y)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        a, _ = self.attention(x, x, x)
        return F.mse_loss(self.head(self.encoder(a).mean(1)).squeeze(-1), y)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def _inner(self, t):
        return torch.tanh(self.b(torch.relu(self.a(t))))

    def forward(self, x, y):
        h = checkpoint(self._inner, x, use_reentrant=False)
        # Reentrant checkpointing needs an input that requires grad.
        h = checkpoint(lambda t: torch.relu(self.c(t)), h, use_reentrant=True)
        return F.mse_loss(self.head(h.mean(1)).squeeze(-1), y)


def _save_matmuls(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default
            else CheckpointPolicy.PREFER_RECOMPUTE)


class SelectiveCheckpointed(nn.Module):
    """Selective activation checkpointing (a dispatch mode that records the
    first forward's ops and replays them in the recompute) around nested
    modules: sharc's own gathers and releases must stay out of its record."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = checkpoint(self.block, self.inp(x), use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                    _save_matmuls))
        return F.mse_loss(self.head(h.mean(1)).squeeze(-1), y)


class CheckpointedTwice(nn.Module):
    """One block called twice, each call checkpointed (once each way): the
    parameters gathered in the first region are read again in the second."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = checkpoint(self.block, x, use_reentrant=False)
        h = checkpoint(self.block, h, use_reentrant=True)
        return F.mse_loss(self.head(h.mean(1)).squeeze(-1), y)


class Assorted(nn.Module):
    def __init__(self):
        super().__init__()
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH))
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.embedding = nn.Embedding(10, WIDTH, padding_idx=0)
        self.sparse = nn.Embedding(10, WIDTH, sparse=True)  # reduced dense
        self.bilinear = nn.Bilinear(WIDTH, WIDTH, 1)

    def forward(self, x, y):
        h = torch.tanh(self.normed(x))
        h = F.gelu(self.conv(h.transpose(1, 2))).transpose(1, 2)
        tokens = (x[..., 0].abs() * 3).long().clamp(max=9)
        e = self.embedding(tokens) + self.sparse(tokens)
        return F.mse_loss(self.bilinear(h.mean(1), e.mean(1)).squeeze(-1), y)


class SparseBags(nn.Module):
    """Embedding bags with sparse gradients: autograd builds each one's
    gradient in one operator (`_embedding_bag_backward(..., sparse=True)`),
    not from a sparse tensor built in the graph as an embedding's, and the
    compiled backward's `_to_dense` of it failed to compile (no fake
    kernel) before the joint graph asked that operator for the dense
    gradient instead."""

    def __init__(self):
        super().__init__()
        self.sum = nn.EmbeddingBag(10, WIDTH, mode="sum", sparse=True, padding_idx=0)
        self.mean = nn.EmbeddingBag(10, WIDTH, mode="mean", sparse=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        tokens = (x[..., 0].abs() * 3).long().clamp(max=9)
        weights = x[..., 1].sigmoid()
        h = self.sum(tokens, per_sample_weights=weights) + self.mean(tokens)
        return F.mse_loss(self.head(h).squeeze(-1), y)


MODELS = {cls.__name__: cls for cls in (Recurrent, PackedRecurrent, Attention, Checkpointed, CheckpointedTwice,
                                         SelectiveCheckpointed, Assorted, SparseBags)}


def _make(name):
    torch.manual_seed(0)
    return MODELS[name]()


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 5, WIDTH, generator=g), torch.randn(2, generator=g)


def _rank(rank, world, name, mode, group=None):
    return scenario.run_sharded(rank, world, lambda: _make(name), batch, mode, 3, group=group)


@functools.cache
def _runs(mode):
    """Every model trained in `mode` in one launch, one after the other, each
    sharded over its own process group: {name: per-rank results}."""
    names = sorted(MODELS)
    runs = run_ranks(scenario.in_own_groups, 2, _rank, [(n, mode) for n in names], timeout=600)
    return {name: [r[i] for r in runs] for i, name in enumerate(names)}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_single_process(name, mode):
    reference = scenario.run_reference(lambda: _make(name), batch, 2, 3)
    results = _runs(mode)[name]
    scenario.assert_matches_reference(results, reference, 2, rtol=1e-4, atol=1e-5)


def _counted_step(counts):
    """A training step under the user's own saved-tensor hooks (as
    `save_on_cpu` installs), counting what they are handed."""
    def step(step_fn, inputs):
        def pack(t):
            counts.append(tuple(t.shape))
            return t.clone()  # kept by the hooks' owner, as an offloader would
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_fn(*inputs)
        loss.backward()
        return loss.detach()
    return step


def _rank_under_hooks(rank, world, mode):
    counts = []
    out = scenario.run_sharded(rank, world, lambda: _make("Checkpointed"), batch, mode, 3,
                               train_step=_counted_step(counts))
    out["counts"] = counts
    return out


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_users_saved_tensor_hooks_see_every_save(mode):
    """Saved-tensor hooks do not chain: sharc's own pair, pushed inside the
    user's, would hide every save from it. sharc leaves the saves to a pair
    that was there first. Compiled, the forward graph saves the shards its
    backward re-gathers from, and the user's pack copies them: the backward
    gathers from a copy, which the runtime once refused as a shard whose
    .data was replaced ([Note: a saved shard copied by the user's hooks])."""
    counts = []
    reference = scenario.run_reference(lambda: _make("Checkpointed"), batch, 2, 3,
                                       train_step=_counted_step(counts))
    results = run_ranks(_rank_under_hooks, 2, mode, timeout=300)
    scenario.assert_matches_reference(results, reference, 2, rtol=1e-4, atol=1e-5)
    for r in results:
        assert len(r["counts"]) > 0
        if mode == "eager":  # a compiled graph saves other tensors than eager code
            assert len(r["counts"]) == len(counts)


def _rank_under_hooks_changing_shards(rank, world):
    import sharc

    model = _make("Checkpointed")
    sharc.shard(model)
    compiled = torch.compile(model, backend="sharc")
    shards = {id(p) for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t.double() if id(t) in shards else t, lambda t: t):
        loss = compiled(*batch(0, rank, world))
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_saved_tensor_hooks_that_change_a_saved_shard_are_named():
    """A copy of a saved shard passes in a compiled backward; one of another
    dtype (an unpack that does not undo its pack) is named as such, not as
    a shard whose .data was replaced."""
    for message in run_ranks(_rank_under_hooks_changing_shards, 2, timeout=300):
        assert message is not None and "came back from the forward's saved tensors" in message, \
            message
        assert "saved_tensors_hooks unpack must return what its pack was given" in message, message


class TwoLayerRecurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(2 * WIDTH, 2 * WIDTH, num_layers=2, batch_first=True)
        self.gru = nn.GRU(2 * WIDTH, 2 * WIDTH, num_layers=2, batch_first=True)
        self.rnn = nn.RNN(2 * WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        h, _ = self.rnn(h)
        return F.mse_loss(self.head(h[:, -1]).squeeze(-1), y)


def _make_two_layer_recurrent():
    torch.manual_seed(0)
    return TwoLayerRecurrent()


def _wide_batch(step, rank, world):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 5, 2 * WIDTH, generator=g), torch.randn(2, generator=g)


def _full_size_tensors(shapes) -> list[tuple[int, ...]]:
    """The shapes of every live tensor in this process that has one of
    `shapes` and memory: a full weight something still holds (a released
    buffer has none)."""
    gc.collect()
    # type(), not isinstance(): that asks some objects for __class__, and
    # torch.distributed.reduce_op warns when asked anything.
    return [tuple(o.shape) for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and tuple(o.shape) in shapes
            and o.untyped_storage().nbytes() > 0]


def _rank_recurrent(rank, world, mode):
    """A sharded run that looks for full weights alive before and after each
    step, and records every warning."""
    model = _make_two_layer_recurrent()
    # Shards are flat: a shape that some shard has too (a bias as long as a
    # shard of a weight, a one-element parameter) cannot tell them apart.
    shard_shapes = {(-(-p.numel() // world),) for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} - shard_shapes
    del model
    alive = []

    def step(step_fn, inputs):
        alive.append(_full_size_tensors(shapes))
        loss = scenario._default_step(step_fn, inputs)
        alive.append(_full_size_tensors(shapes))
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = scenario.run_sharded(rank, world, _make_two_layer_recurrent, _wide_batch, mode, 3,
                                   train_step=step)
    out["alive"] = alive
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_recurrent_layers_keep_no_full_weight_between_steps(mode):
    """nn.LSTM, nn.GRU and nn.RNN keep their weights in a list (`_flat_weights`)
    between calls: kept, that list held every gathered weight past its
    release (the whole model, counted nowhere, and a warning per weight).
    Training still equals one process; before and after every step no
    tensor of a parameter's shape has memory, sharc counts nothing
    gathered, and nothing warns."""
    reference = scenario.run_reference(_make_two_layer_recurrent, _wide_batch, 2, 3)
    results = run_ranks(_rank_recurrent, 2, mode, timeout=300)
    scenario.assert_matches_reference(results, reference, 2, rtol=1e-4, atol=1e-5)
    for rank, r in enumerate(results):
        assert r["left"] == [0, 0, 0], r["left"]
        assert all(not shapes for shapes in r["alive"]), f"rank {rank}: {r['alive']}"
        assert r["warnings"] == [], f"rank {rank}: {r['warnings']}"


class SpectralNormedRecurrent(nn.Module):
    """Spectral norm (`parametrizations.spectral_norm`) on two weights of a
    bidirectional 2-layer GRU, neither its first: each read of such a weight
    runs a power iteration, which updates the `_u`/`_v` buffers, and torch's
    own refill of the layer's weight list reads the first one four times and
    the other twice per forward. Read once each, the buffers, the estimated
    norms and so the weights and losses drifted from one process's."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(WIDTH, WIDTH, num_layers=2, bidirectional=True, batch_first=True)
        nn.utils.parametrizations.spectral_norm(self.gru, "weight_hh_l0")
        nn.utils.parametrizations.spectral_norm(self.gru, "weight_ih_l1_reverse")
        self.head = nn.Linear(2 * WIDTH, 1)

    def forward(self, x, y):
        h, _ = self.gru(x)
        return F.mse_loss(self.head(h[:, -1]).squeeze(-1), y)


def _make_spectral_normed_recurrent():
    torch.manual_seed(0)
    return SpectralNormedRecurrent()


def _rank_spectral_normed(rank, world, mode):
    return scenario.run_sharded(rank, world, _make_spectral_normed_recurrent, batch, mode, 3)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_parametrized_recurrent_weights_are_read_as_often_as_torch_reads_them(mode):
    reference = scenario.run_reference(_make_spectral_normed_recurrent, batch, 2, 3)
    results = run_ranks(_rank_spectral_normed, 2, mode, timeout=300)
    scenario.assert_matches_reference(results, reference, 2)
