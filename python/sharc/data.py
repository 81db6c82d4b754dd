"""Tiny Shakespeare, bundled, as character tokens."""

from __future__ import annotations

from importlib import resources

import torch


class CharDataset:
    """The bundled text encoded one token per character."""

    def __init__(self, text: str | None = None):
        if text is None:
            text = resources.files("sharc").joinpath("data/tinyshakespeare.txt").read_text()
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def global_batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0):
        """(inputs, targets) of `batch_size` random windows; the same on every
        rank for the same step, so ranks can take disjoint slices of it."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([self.tokens[s:s + seq_len] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1:s + seq_len + 1] for s in starts.tolist()])
        return x, y

    def rank_batch(self, step: int, batch_per_rank: int, seq_len: int, rank: int,
                   world_size: int, seed: int = 0):
        """This rank's slice of the global batch of batch_per_rank * world_size."""
        x, y = self.global_batch(step, batch_per_rank * world_size, seq_len, seed)
        sl = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
        return x[sl], y[sl]
