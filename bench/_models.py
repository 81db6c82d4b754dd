"""The benchmark's models beyond the GPT: a small BERT-like encoder, and a
GPT whose every block breaks Dynamo's graph twice. Each takes (tokens,
targets) and returns the mean cross-entropy, like the GPT."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from sharc.models.gpt import GPT, GPTConfig, Block


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 65
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


class BertLikeEncoder(nn.Module):
    """Token and position embeddings, post-norm nn.TransformerEncoder
    layers (bidirectional attention, GELU), a token classification head:
    the shape of a 2-layer BERT."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.norm = nn.LayerNorm(cfg.n_embd)
        layer = nn.TransformerEncoderLayer(cfg.n_embd, cfg.n_head, 4 * cfg.n_embd, dropout=0.0,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.encoder(self.norm(self.tok(idx) + self.pos(pos)))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class BrokenBlock(Block):
    """A GPT block with a graph break after its attention and after its MLP
    (a print, a .item(), a data-dependent branch in real code)."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        torch._dynamo.graph_break()
        x = x + self.mlp(self.ln2(x))
        torch._dynamo.graph_break()
        return x


class BrokenConfig(GPTConfig):
    """A GPTConfig that asks for the GraphBrokenGPT."""


class GraphBrokenGPT(GPT):
    """The GPT with BrokenBlocks: 2 graph breaks per block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(BrokenBlock(cfg) for _ in range(cfg.n_layer))
        self.apply(self._init_weights)


@dataclass(frozen=True)
class SwitchConfig:
    """A small HF SwitchTransformers encoder-decoder (mixture of experts,
    its routing data-dependent, so Dynamo breaks its graph many times)."""
    vocab_size: int = 65
    block_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_experts: int = 4


class SwitchLM(nn.Module):
    """SwitchTransformersForConditionalGeneration trained to copy its input
    (tokens in, the same tokens as labels), called like the GPT. Its sparse
    MLPs are sharc gather units: routing picks different experts per rank."""

    gather_units = ("*.mlp",)

    def __init__(self, cfg: SwitchConfig):
        super().__init__()
        from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

        self.config = cfg
        hf = SwitchTransformersConfig(
            vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_model // 4,
            d_ff=2 * cfg.d_model, num_layers=cfg.n_layer, num_decoder_layers=cfg.n_layer,
            num_heads=4, num_experts=cfg.n_experts, expert_capacity=cfg.block_size,
            encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        self.model = SwitchTransformersForConditionalGeneration(hf)

    def forward(self, idx, targets):
        return self.model(input_ids=idx, labels=targets).loss
