"""zero_grad() and optimizer steps over gradients no_sync holds back.

See [Note: gradients held by no_sync] (src/runtime/runtime_held_gradients.cpp):
the sums live in the runtime while .grad reads zeros, so torch's zero_grad
cannot reach them and an optimizer step cannot see them. `install()` wraps
`torch.optim.Optimizer.zero_grad` and `torch.nn.Module.zero_grad` once per
process (every subclass that does not override them): after torch's own
reset, the shards among the parameters drop what was held. The step check
runs in sharc's optimizer step pre-hook.
"""

from __future__ import annotations

import functools

import torch

from sharc._optimizer_writes import optimizer_params, runtimes_of


def discard(params) -> None:
    for runtime, pids in runtimes_of(params):
        runtime.discard_held_back(pids)


def refuse_step_over_held(optimizer) -> None:
    """Optimizer step pre-hook part: a step while no_sync holds gradients of
    its shards would step on zeros and add the sums into the next step."""
    for runtime, pids in runtimes_of(optimizer_params(optimizer)):
        names = runtime.held_back(pids)
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise RuntimeError(
                f"sharc: {type(optimizer).__name__}.step() while sharc.no_sync() holds back "
                f"the gradient of '{names[0]}'{more}: no backward outside no_sync() has "
                "reduced it, so the shards' .grad do not hold it yet. Run the last "
                "micro-batch's backward outside no_sync(), or call zero_grad() to discard "
                "what was accumulated. no_sync(model) is its process group's setting: it "
                "holds back the gradients of every model sharded over that group whose "
                "backward runs inside it, not only the model given to it (run another "
                "model's backward outside it)")


def _wrap(cls, params_of) -> None:
    torch_zero_grad = cls.zero_grad
    if getattr(torch_zero_grad, "_sharc_wraps", None) is not None:
        return

    # Never traced: the runtime is not a graph's to call (torch keeps
    # Optimizer.zero_grad out of Dynamo too).
    @torch.compiler.disable
    @functools.wraps(torch_zero_grad)
    def zero_grad(self, *args, **kwargs):
        torch_zero_grad(self, *args, **kwargs)
        discard(params_of(self))

    zero_grad._sharc_wraps = torch_zero_grad
    cls.zero_grad = zero_grad


@functools.cache
def install() -> None:
    _wrap(torch.optim.Optimizer, optimizer_params)
    _wrap(torch.nn.Module, lambda module: module.parameters())
