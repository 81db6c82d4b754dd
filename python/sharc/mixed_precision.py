"""Mixed precision: compute in a small floating dtype, keep fp32 master state.

The shards (what the optimizer updates) stay in the model's dtype. Each
parameter is cast shard-first and gathered in `param_dtype` (half the bytes
of fp32 for bf16/fp16), its gradient is reduce-scattered in `reduce_dtype`
and lands in the shard's `.grad` in the shard's own dtype (or its
`grad_dtype`). See docs/design/mixed-precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """The dtypes sharc gathers, reduces and returns in; `None` keeps a dtype
    as it is. Pass it as `ShardConfig(mixed_precision=...)`."""

    param_dtype: torch.dtype | None = None
    """The dtype of gathered parameters, which forward computes with;
    floating-point inputs to the root module's forward are cast to it
    (unless cast_forward_inputs is False). Integer and bool parameters keep
    their own dtype."""

    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are summed over ranks in (default: param_dtype).
    Gradients land in the shards' `.grad` in the master dtype whatever it is."""

    output_dtype: torch.dtype | None = None
    """Floating-point outputs of the root module's forward are cast to it."""

    full_precision_modules: tuple[type, ...] = (torch.nn.modules.batchnorm._BatchNorm,)
    """Modules whose parameters are gathered in their own dtype whatever
    `param_dtype` says (their gradients are reduced like every other). By default the batch norms: their
    running statistics are buffers in the model's dtype, torch's kernels
    take a narrow input beside wide weights and statistics but not narrow
    weights beside wide statistics, and the statistics need the width. `()`
    casts every module."""

    # Last, so that fields given by position keep their places.
    cast_forward_inputs: bool = True
    """Cast the floating-point inputs of the root module's forward to
    param_dtype. False hands them over as given, for a forward that casts
    its inputs itself or keeps some in full precision (a mask, a timestep)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecision.{name} must be a torch.dtype (such as "
                                f"torch.bfloat16) or None, got {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError("MixedPrecision.cast_forward_inputs must be a bool, got "
                            f"{self.cast_forward_inputs!r}")
        modules = self.full_precision_modules
        if not (isinstance(modules, tuple) and all(isinstance(m, type) and
                                                  issubclass(m, torch.nn.Module)
                                                  for m in modules)):
            raise TypeError("MixedPrecision.full_precision_modules must be a tuple of "
                            f"torch.nn.Module classes (such as (torch.nn.LayerNorm,)), got "
                            f"{modules!r}")
        if self.output_dtype is not None and not self.output_dtype.is_floating_point:
            raise ValueError("MixedPrecision.output_dtype must be a floating-point dtype, got "
                             f"{self.output_dtype}")


@dataclass(frozen=True, slots=True)
class ParamDtypes:
    """One parameter's dtypes: gathered in, reduced in, delivered in."""

    gather: torch.dtype
    reduce: torch.dtype
    grad: torch.dtype


def param_dtypes(fqn: str, p: torch.nn.Parameter, owner: torch.nn.Module,
                 policy: MixedPrecision | None) -> ParamDtypes:
    """The dtypes `policy` gives parameter `fqn` of module `owner`;
    ValueError naming it and the fix when the policy would widen it or
    make it an integer."""
    grad = p.grad_dtype if p.requires_grad else p.dtype
    if policy is None or not p.dtype.is_floating_point:
        return ParamDtypes(p.dtype, grad, grad)  # integer and bool parameters: never cast
    for field in ("param_dtype", "reduce_dtype"):
        _check_narrowing(fqn, p.dtype, field, getattr(policy, field))
    gather = policy.param_dtype or p.dtype
    reduce = policy.reduce_dtype or policy.param_dtype or grad
    if isinstance(owner, policy.full_precision_modules):
        # Gathered in its own dtype; reduced as every other gradient, so a
        # bucket it shares is not widened (all of it sent at the wider size).
        gather = p.dtype
    return ParamDtypes(gather, reduce, grad)


def _check_narrowing(fqn: str, master: torch.dtype, field: str, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if not dtype.is_floating_point:
        raise ValueError(
            f"sharc: MixedPrecision.{field}={dtype} is not a floating-point dtype "
            f"(parameter '{fqn}' is {master}); use torch.bfloat16 or torch.float16, or "
            "None to keep the parameters' dtype")
    if dtype.itemsize > master.itemsize:
        raise ValueError(
            f"sharc: MixedPrecision.{field}={dtype} is wider than parameter '{fqn}' "
            f"({master}); mixed precision only narrows. Use a {field} no wider than "
            f"{master}, or convert the model to {dtype} before sharc.shard()")


def install_casts(root: torch.nn.Module, policy: MixedPrecision) -> None:
    """Casts the root forward's floating inputs to param_dtype (if
    cast_forward_inputs) and its floating outputs to output_dtype."""
    param_dtype, output_dtype = policy.param_dtype, policy.output_dtype
    if param_dtype is not None and policy.cast_forward_inputs:
        root.register_forward_pre_hook(
            lambda _, args, kwargs: (_cast_floats(args, param_dtype),
                                     _cast_floats(kwargs, param_dtype)),
            with_kwargs=True)
    if output_dtype is not None:
        root.register_forward_hook(lambda _, args, output: _cast_floats(output, output_dtype))


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree)
