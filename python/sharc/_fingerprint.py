"""One fingerprint for "what a rank means to do" and "what a rank holds":
the values ranks exchange and compare (or a rank compares before and after).

Every Python site that asks "do the ranks agree?" hashes with `fingerprint`:
the rank check's load checksums (`_rank_check.checksum`), the files a load
reads (`checkpoint/load_sources.py`), the replica check at `shard()` and the changes
`sharc.unsharded` writes back (`_validate`, `unsharded.py`).

Not here, on purpose:
- the C++ collective fingerprint (`CollectiveAgreement::fingerprint`,
  FNV-1a over a collective's kind, dtype and parameter ids): it runs on
  every collective, on the hot path, in the torch-free core, and goes into
  each collective's header; a few integer multiplies, where this one hashes
  bytes once per call.
- a checkpoint's file hashes (`checkpoint/directory.py`'s `_file_digest`): written into the
  checkpoint's manifest and checked against the files on disk, so their
  format is the checkpoint format's, not a value ranks compare.
"""

from __future__ import annotations

import hashlib

import torch


def fingerprint(*parts: str | torch.Tensor) -> int:
    """An order-sensitive 63-bit blake2b hash of `parts`, one after another:
    a string's UTF-8 bytes, a tensor's raw bytes element by element in
    row-major order (any dtype, bf16 too, through a `uint8` view; shape and
    dtype are the caller's to add as text). Any changed, moved or swapped
    element or part changes it (a sum would not see two swapped values).
    Non-negative, so it fits an int64 tensor."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, torch.Tensor):
            flat = part.detach().reshape(-1).contiguous().cpu()
            if flat.numel() == 1 and flat.stride(0) != 1:
                # One element counts as contiguous whatever its stride (a
                # (1,) view of a wider buffer keeps the buffer's), and a
                # byte view needs stride 1.
                flat = flat.clone(memory_format=torch.contiguous_format)
            raw = flat.view(torch.uint8)
            h.update(raw.numpy())
        else:
            h.update(part.encode())
    return int.from_bytes(h.digest(), "little") >> 1
