"""Where sharc.load_full_state_dict reads full tensors from: a dict in
memory, a `torch.save` file, or safetensors files. Each answers a key's
shape and dtype without reading its values, and reads a flat element range
of one tensor, so a rank takes its slice of one tensor at a time and never
holds the whole state dict (nor, for safetensors, a whole tensor: at most
the rows its range touches)."""

from __future__ import annotations

import json
import math
import os

import torch

from sharc import _rank_check
from sharc._fingerprint import fingerprint


class DictSource:
    """Full tensors in memory (the caller holds them)."""

    collective = False  # reads are local (Rank0Source's are collectives)

    def __init__(self, state_dict: dict):
        self._sd = state_dict

    def keys(self) -> list[str]:
        return list(self._sd)

    def check_tensor(self, key: str) -> None:
        given = self._sd[key]
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"load_full_state_dict: '{key}' is a {type(given).__name__}, not a "
                            "tensor; pass the full tensors (e.g. from sharc.full_state_dict or "
                            "an unsharded model's state_dict())")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._sd[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._sd[key].dtype

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._sd[key].reshape(-1)[lo:hi]

    def read(self, key: str) -> torch.Tensor:
        return self._sd[key]

    def done_with(self, nbytes: int) -> None:
        """The last read (of `nbytes`) has been copied out of."""

    def fingerprint(self, keys: list[str]) -> int:
        """What every rank must agree on: the values themselves."""
        return _rank_check.checksum({k: self._sd[k] for k in keys})


# [Note: mapped pages] A file read through a memory mapping leaves every page
# it touched resident in this process (counted in its resident set) until
# the mapping goes, though the kernel may drop them; and the kernel maps more
# than was read (its read-around: measured 1.5x for a torch.save file, 2x for
# safetensors rows). Over a whole load that would be about twice this rank's
# share of the file on top of its shards, so a file source maps its file
# afresh after every _REMAP_BYTES read from it (cheap: the header, or the
# pickled metadata, is read again). Measured (bench/meta_init_memory.py, 4
# ranks, 50 MB of shards each): a safetensors load peaked 35-52 MB above the
# shards remapping every 16 MiB, 20-27 MB every 8 MiB.
_REMAP_BYTES = 8 << 20


class TorchFileSource(DictSource):
    """A `torch.save` state dict, memory-mapped: reading a slice touches only
    that slice's pages of the file."""

    def __init__(self, path: str):
        self._path = path
        super().__init__(self._map())
        self._size = os.path.getsize(path)
        self._since_mapped = 0

    def _map(self) -> dict:
        try:
            sd = torch.load(self._path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001  (any unreadable file: say which)
            raise ValueError(f"load_full_state_dict: cannot read '{self._path}' as a "
                             f"torch.save file ({type(e).__name__}: {e})") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError(f"load_full_state_dict: '{self._path}' does not hold a flat state "
                             "dict (names to tensors); save model.state_dict() itself")
        return sd

    def done_with(self, nbytes: int) -> None:
        self._since_mapped += nbytes
        if self._since_mapped >= _REMAP_BYTES:  # see [Note: mapped pages]
            self._sd = None  # the old mapping goes before the new one comes
            self._sd = self._map()
            self._since_mapped = 0

    def fingerprint(self, keys: list[str]) -> int:
        return _metadata_fingerprint(self, keys, [self._size])


# safetensors' dtype names (safe_open(...).get_slice(k).get_dtype()).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


class SafetensorsSource:
    """One or several safetensors files (a Hugging Face model directory, its
    `model.safetensors.index.json` naming the files), read one slice of one
    tensor at a time."""

    collective = False

    def __init__(self, paths: list[str]):
        self._paths = paths
        self._sizes = [os.path.getsize(p) for p in paths]
        self._map()
        self._since_mapped = 0

    def _map(self) -> None:
        from safetensors import safe_open

        self._where: dict[str, object] = {}  # key -> its file, opened (mapped)
        for path in self._paths:
            f = safe_open(path, framework="pt", device="cpu")
            for key in f.keys():
                if key in self._where:
                    raise ValueError(f"load_full_state_dict: '{key}' is in more than one of "
                                     f"the files {self._paths}")
                self._where[key] = f

    def done_with(self, nbytes: int) -> None:
        self._since_mapped += nbytes
        if self._since_mapped >= _REMAP_BYTES:  # see [Note: mapped pages]
            self._where = {}
            self._map()
            self._since_mapped = 0

    def keys(self) -> list[str]:
        return list(self._where)

    def check_tensor(self, key: str) -> None:
        pass  # a safetensors file holds only tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype | str:
        name = self._where[key].get_slice(key).get_dtype()
        return _SAFETENSORS_DTYPES.get(name, name)

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        shape = self.shape(key)
        if not shape or lo == hi:
            return self.read(key).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])  # elements per index of the first dimension
        first, last = lo // row, -(-hi // row)
        rows = self._where[key].get_slice(key)[first:last]  # reads only these rows
        return rows.reshape(-1)[lo - first * row:hi - first * row]

    def read(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def fingerprint(self, keys: list[str]) -> int:
        return _metadata_fingerprint(self, keys, self._sizes)


def _metadata_fingerprint(source, keys: list[str], sizes: list[int]) -> int:
    """Names, shapes, dtypes and file sizes, without reading values: ranks
    reading different files (or versions of one) disagree."""
    return fingerprint(*(f"{key}:{source.shape(key)}:{source.dtype(key)};" for key in keys),
                       repr(sizes))


def open_source(given) -> DictSource | TorchFileSource | SafetensorsSource:
    """The source for a state dict or a path: a `.safetensors` file, a
    directory of them, or a `torch.save` file."""
    if isinstance(given, dict):
        return DictSource(given)
    if not isinstance(given, (str, os.PathLike)):
        raise TypeError("load_full_state_dict: pass a state dict (names to full tensors) or the "
                        f"path of a torch.save or safetensors file, got {type(given).__name__}")
    path = os.fspath(given)
    if os.path.isdir(path):
        return SafetensorsSource(_safetensors_in(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_full_state_dict: no file '{path}'")
    if path.endswith(".safetensors"):
        return SafetensorsSource([path])
    return TorchFileSource(path)


def _safetensors_in(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"load_full_state_dict: no .safetensors files in '{directory}'")
    return [os.path.join(directory, n) for n in names]
