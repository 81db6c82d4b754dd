"""The error the compile path raises for graphs it cannot schedule."""


class SharcCompileError(RuntimeError):
    """A graph sharc's backend cannot schedule; the message says why and what
    to change (or that it is a sharc bug to report)."""
