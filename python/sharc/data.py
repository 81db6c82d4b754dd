"""Tiny Shakespeare, bundled, as character tokens, split into training text
(the first 90%) and held-out validation text (the last 10%). Batches of the
whole text (split=None) are what the tests and the benchmark use."""

from __future__ import annotations

from importlib import resources

import torch

SPLITS = ("train", "val")


class CharDataset:
    """The bundled text encoded one token per character."""

    def __init__(self, text: str | None = None, val_fraction: float = 0.1):
        if text is None:
            text = resources.files("sharc").joinpath("data/tinyshakespeare.txt").read_text()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = self.encode(text)
        cut = int(len(self.tokens) * (1.0 - val_fraction))
        self._splits = {"train": self.tokens[:cut], "val": self.tokens[cut:]}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)

    def split(self, name: str | None) -> torch.Tensor:
        """The tokens of split `name`; None: the whole text."""
        if name is None:
            return self.tokens
        if name not in self._splits:
            raise ValueError(f"unknown split '{name}'; choose one of {SPLITS}")
        return self._splits[name]

    def global_batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
                     split: str | None = None):
        """(inputs, targets) of `batch_size` random windows of `split`; a pure
        function of its arguments, so the same on every rank (ranks take
        disjoint slices) and after a resume (the step is the data position)."""
        tokens = self.split(split)
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the {split} split has {len(tokens)} tokens, too few for "
                             f"windows of {seq_len}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts.tolist()])
        return x, y

    def rank_batch(self, step: int, batch_per_rank: int, seq_len: int, rank: int,
                   world_size: int, seed: int = 0, split: str | None = None):
        """This rank's slice of the global batch of batch_per_rank * world_size."""
        x, y = self.global_batch(step, batch_per_rank * world_size, seq_len, seed, split)
        sl = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
        return x[sl], y[sl]
