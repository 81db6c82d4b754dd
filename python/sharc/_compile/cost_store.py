"""Measured costs kept on disk, so that a later process of the same job
schedules its graphs as this one did.

sharc's graphs embed their schedule, and the schedule embeds the measured
compute and collective costs (profile.py, collective_costs.py): a process
that measured anew scheduled differently, its graphs' keys in Inductor's
FX graph cache differed, and every run compiled everything again. Kept
here, the costs a process measured are the costs the next one schedules
from.

The files live in a `sharc` folder of Inductor's cache directory: a fresh
Inductor cache (TORCHINDUCTOR_CACHE_DIR elsewhere, bench/compare.py's
`--inductor-cache fresh`) is a fresh start for sharc's costs too. A file
holds what it is valid for (`environment`: host, CPU and CUDA devices,
torch's version, sharc's library, plus the caller's own facts) beside
its entries; one whose facts differ from this process's, or that cannot be
read or parsed, is treated as absent and the costs are measured anew.
Written to a temporary file and renamed over the old one, so a process
reading it (another rank, another job) sees a whole file, old or new.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
import tempfile

import torch

_FORMAT = 1  # bumped when the files' layout changes


def load(name: str, facts: dict) -> dict | None:
    """The entries of file `name` when it was written for this environment
    and `facts`; None when it is missing, unreadable or for other facts."""
    try:
        with open(_path(name, facts)) as f:
            stored = json.load(f)
        if stored["valid_for"] != _valid_for(facts) or not isinstance(stored["entries"], dict):
            return None
        return stored["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(name: str, facts: dict, entries: dict) -> None:
    """Writes `entries` to file `name` at once (temporary file, then rename).
    A failure to write (a read-only or full disk) only loses the entries."""
    path = _path(name, facts)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"valid_for": _valid_for(facts), "entries": entries}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def directory() -> str:
    """The `sharc` folder of Inductor's cache directory (read each time:
    TORCHINDUCTOR_CACHE_DIR may be set after import)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "sharc")


def _path(name: str, facts: dict) -> str:
    """One file per name and environment: costs of another machine or
    another torch live beside these rather than over them."""
    digest = hashlib.blake2b(json.dumps(_valid_for(facts), sort_keys=True).encode(),
                             digest_size=8).hexdigest()
    return os.path.join(directory(), f"{name}-{digest}.json")


def _valid_for(facts: dict) -> dict:
    return {"format": _FORMAT, **_environment(), **facts}


@functools.cache
def _environment() -> dict:
    """What any measured cost depends on in this process."""
    cuda = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "cuda": cuda,
            "torch": torch.__version__, "sharc": _library_digest()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _library_digest() -> str:
    """sharc's C++ library by content: a rebuilt library may schedule or
    communicate differently."""
    from sharc._library import _LIBRARY

    digest = hashlib.blake2b(digest_size=8)
    with open(_LIBRARY, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
