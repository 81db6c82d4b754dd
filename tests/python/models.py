"""Models and single-process references shared by the tests."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from sharc.data import CharDataset
from sharc.models.gpt import GPT, GPTConfig


class GraphBreakBlock(nn.Module):
    """A linear layer and a ReLU that end a compiled graph: stacked, a model
    split by graph breaks into one small graph per block."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        x = torch.relu(self.fc(x))
        torch._dynamo.graph_break()
        return x


class ParityGPT(GPT):
    """The GPT with every layout edge case the parity tests must cover:
    an output head tied to the embedding, a head bias of 65 elements (not
    divisible by 2 or 4), a 0-dim temperature (fewer elements than ranks), a
    zero-size parameter, a frozen parameter (position embedding) and buffers
    (the causal masks)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.empty = nn.Parameter(torch.zeros(0))
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx, targets):
        logits = super().forward(idx) * self.temperature + self.empty.sum()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def parity_config() -> GPTConfig:
    return GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=24,
                     head_bias=True)


def make_parity_model(seed: int = 0) -> ParityGPT:
    torch.manual_seed(seed)
    return ParityGPT(parity_config())


@functools.lru_cache(maxsize=1)
def _dataset() -> CharDataset:
    return CharDataset()


def global_batch(step: int, batch: int, seq: int = 16):
    """Windows of the bundled Tiny Shakespeare, the same on every rank."""
    return _dataset().global_batch(step, batch, seq, seed=7)


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.size(0) // world
    return t[rank * per:(rank + 1) * per]


def train_losses(model, opt, steps: int, rank: int, world: int, batch: int = 4) -> list[float]:
    """`steps` next-character steps of a GPT on this rank's slice of the
    global batch (step i reads batch i); each step's loss."""
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch)
        logits = model(rank_slice(x, rank, world))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 rank_slice(y, rank, world).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The reference layout: flatten, pad to W * ceil(n / W), take slice r."""
    n = full.numel()
    s = -(-n // world)
    padded = torch.zeros(world * s, dtype=full.dtype)
    padded[:n] = full.reshape(-1)
    return padded[rank * s:(rank + 1) * s]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def train_single(steps: int, batch: int):
    """The unsharded reference: the parity model trained on one process with
    the whole global batch; returns (losses, final state_dict)."""
    model = make_parity_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def gathered_beyond_kept(group=None) -> int:
    """Bytes gathered now (over `group`, default the world) beyond the
    parameters the compiled schedule chose to keep gathered (selective
    unsharding, counted in kept_gathered_bytes): what a missed release
    leaves behind. 0 is the only right value between steps."""
    import sharc

    stats = sharc.memory_stats(group)
    return stats["gathered_bytes"] - stats["kept_gathered_bytes"]


class TopOneMoE(nn.Module):
    """A mixture-of-experts layer with top-1 routing: which experts run
    depends on this rank's tokens. `fail` makes its forward raise (a
    forward that fails inside a gather unit)."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("planned failure inside a unit")
        gate = self.router(x).softmax(-1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().flatten()
            if idx.numel():
                out = out.index_add(0, idx, expert(x[idx]) * gate[idx, e:e + 1])
        return x + out


class ThreeMoELayers(nn.Module):
    """Rows of 4 features through three TopOneMoE layers (name them
    `layers.0` to `layers.2` as gather units) to a squared-mean loss."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(TopOneMoE(width, experts) for _ in range(3))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        # Unrolled: Dynamo gives up a whole frame whose loop breaks the graph.
        h = torch.tanh(self.layers[0](self.inp(x)))
        h = torch.tanh(self.layers[1](h))
        h = torch.tanh(self.layers[2](h))
        return self.out(h).pow(2).mean()


def small_switch_transformers():
    """A small HF SwitchTransformers: every MLP sparse (four experts), its
    embedding tied to the encoder's and decoder's input and the output head,
    the same weights on every rank."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    config = SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, num_experts=4, expert_capacity=8, encoder_sparse_step=1,
        decoder_sparse_step=1, router_jitter_noise=0.0, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)
    return SwitchTransformersForConditionalGeneration(config)
