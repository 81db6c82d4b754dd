"""sharc's compile path: the "sharc" torch.compile backend and its FX bridge
to the C++ scheduling passes. See docs/design/compiled-schedule.md."""

from sharc._compile.backend import register, sharc_backend

__all__ = ["register", "sharc_backend"]
