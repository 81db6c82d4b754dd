"""Loads sharc's C++ library, which registers torch.ops.sharc and
torch.classes.sharc."""

from pathlib import Path

import torch

_LIBRARY = Path(__file__).parent / "lib" / "libsharc_torch.so"


def load() -> None:
    if not _LIBRARY.exists():
        raise ImportError(
            f"sharc's C++ library is missing ({_LIBRARY}); install sharc with "
            "scripts/setup.sh (pip install --no-build-isolation .) so it is built")
    torch.ops.load_library(str(_LIBRARY))


load()
Runtime = torch.classes.sharc.Runtime
