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
    gather_dtype: torch.dtype  # what forward reads (the shard's dtype without mixed precision)

    def gather_op(self) -> torch.Tensor:
        """The autograd-aware gather, in the gather dtype (the shard cast
        first): its gradient is a reduce-scatter into the shard."""
        return torch.ops.sharc.gather(self.shard, list(self.shape), self.group_name, self.pid)

    def all_gather_op(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The functional gather: a full tensor of its own in the shard's
        dtype, gradient reduce-scattered into the shard (or into `shard`, a
        tracer's stand-in for it)."""
        shard = self.shard if shard is None else shard
        return torch.ops.sharc.all_gather(shard, list(self.shape), self.group_name, self.pid)

    def traced_read(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """What a compiled graph captures for a read: the functional gather,
        then the cast to the gather dtype, which sharc's cast_before_gather
        pass folds into the gather (any other backend sees plain values)."""
        full = self.all_gather_op(shard)
        return full if full.dtype == self.gather_dtype else full.to(self.gather_dtype)
