"""The Python record of one sharded parameter."""

from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)
class ShardedParamRef:
    """Everything the eager schedule and the compile path need to gather one
    parameter: the runtime's id for it and the nn.Parameter holding the shard."""

    runtime: object  # torch.classes.sharc.Runtime
    group_name: str
    pid: int
    fqn: str  # canonical name (the first module path that owns it)
    shape: tuple[int, ...]
    shard: torch.nn.Parameter

    def gather_op(self) -> torch.Tensor:
        """The autograd-aware gather: its gradient is a reduce-scatter into
        the shard."""
        return torch.ops.sharc.gather(self.shard, list(self.shape), self.group_name, self.pid)

    def all_gather_op(self) -> torch.Tensor:
        """The functional gather that compiled graphs capture: a full tensor
        of its own, gradient reduce-scattered into the shard."""
        return torch.ops.sharc.all_gather(self.shard, list(self.shape), self.group_name, self.pid)
