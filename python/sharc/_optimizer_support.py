"""Optimizers that cannot train sharc's flat shards, refused with the reason.

[Note: optimizers over whole parameters]
After shard() every parameter an optimizer holds is this rank's flat 1-D
slice of it. An element-wise optimizer (SGD, Adam, AdamW, Adagrad, ...)
computes each element from that element alone, so its numbers on a slice
are exactly those on the whole. A few of torch's compute over the whole
parameter or over all parameters together: on shards they would silently
compute other numbers (Adafactor, and other libraries' LAMB, LARS, AdamP,
NovoGrad, Kron and Shampoo), let the ranks decide differently and
desynchronise their forwards (LBFGS's stopping test), or fail with
torch's own message that never says why (Muon, SparseAdam). So sharc's
optimizer step pre-hook refuses them at their first step when they hold
a shard, naming the reason and what to use instead; over parameters sharc
does not hold (an unsharded model in the same process) they step as ever.
Muon refuses a 1-D parameter in its constructor, before any step, so its
constructor is wrapped to give the same explanation.

Classes are recognised by the names along their MRO, so another library's
class of the same algorithm (transformers' Adafactor) is refused too. The
hook runs on every step of every optimizer: other classes cost one cached
lookup by type, and a refusable one over no shard is looked at again
only after its param groups changed (add_param_group).
"""

from __future__ import annotations

import functools
import weakref

import torch

from sharc._optimizer_writes import SHARD_PID

_ELEMENT_WISE = ("use an element-wise optimizer such as torch.optim.AdamW, which computes "
                 "the same numbers on shards as on whole parameters")

# torch.optim class name -> (what it computes that a shard does not hold, what to use instead)
_REFUSED = {
    "LBFGS": (
        "it takes dot products, norms and the largest absolute value of the gradient of all "
        "parameters together, which on shards each rank would take over its own slice only: "
        "the numbers change, and its stopping test can stop on one rank but not another, "
        "desynchronising the ranks",
        "train a model for LBFGS unsharded (LBFGS keeps its whole history on every rank "
        f"anyway), or {_ELEMENT_WISE}"),
    "Adafactor": (
        "it factors each parameter's second moment by the rows and columns of its 2-D shape "
        "and scales each update by the whole parameter's RMS; a shard has neither, so the "
        "numbers would silently differ",
        f"{_ELEMENT_WISE}; for Adafactor's memory savings, sharc's sharding already divides "
        "the optimizer state across the ranks"),
    "Muon": (
        "it orthogonalises each parameter's update as a 2-D matrix, which a 1-D slice of it "
        "is not",
        _ELEMENT_WISE),
    "SparseAdam": (
        "it needs sparse gradients, and sharc reduce-scatters every gradient, a sparse "
        "embedding's too, into a dense shard",
        _ELEMENT_WISE),
}

# Other libraries' algorithms of the same kind (timm's, apex's, bitsandbytes',
# torch_optimizer's classes go by these names), measured on timm's Lamb: 2
# ranks' losses 1.37 and 1.51 against one process's 1.59 and 1.52 after its
# first step. Element-wise ones (Lion, Adan, MADGRAD, ADOPT, RAdam, LaProp)
# train shards as they do whole parameters.
_TRUST_RATIO = (
    "it scales each parameter's update by a ratio of that whole parameter's norms (the "
    "weight's to the update's or the gradient's), and a shard's norm is its slice's alone, "
    "so the numbers would silently differ",
    f"{_ELEMENT_WISE} (without its trust ratio, LAMB is AdamW)")
_MATRIX_PRECONDITIONER = (
    "it preconditions each gradient by matrices built along the parameter's dimensions, "
    "which a flat 1-D slice does not have",
    _ELEMENT_WISE)
for _name in ("Lamb", "LAMB", "FusedLamb", "FusedLAMB", "LAMB8bit", "LAMB32bit",
              "Lars", "LARS", "LARS8bit", "LARS32bit"):
    _REFUSED[_name] = _TRUST_RATIO
for _name in ("Kron", "Shampoo", "DistributedShampoo", "SOAP"):
    _REFUSED[_name] = _MATRIX_PRECONDITIONER
_REFUSED["AdafactorBigVision"] = _REFUSED["Adafactor"]
for _name in ("AdamP", "SGDP"):
    _REFUSED[_name] = (
        "it removes from each update its part along the whole parameter (or along each of "
        "its output channels), by a cosine a flat slice cannot take, so the numbers would "
        "silently differ", _ELEMENT_WISE)
for _name in ("NovoGrad", "NvNovoGrad"):
    _REFUSED[_name] = (
        "its second moment is one number per parameter, the whole parameter's squared "
        "gradient norm, which on a shard is its slice's alone, so the numbers would "
        "silently differ", _ELEMENT_WISE)
_REFUSED["Mars"] = (
    "it clips each parameter's corrected gradient by that whole parameter's norm and treats "
    "2-D parameters apart, neither of which a flat slice tells", _ELEMENT_WISE)
_REFUSED["Adahessian"] = (
    "it averages its Hessian estimate over each convolution kernel by the parameter's 4-D "
    "shape, which a flat slice does not have", _ELEMENT_WISE)

# optimizer -> how many param groups it had when found to hold no shard
_NO_SHARD_SEEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = (
    weakref.WeakKeyDictionary())


@functools.cache
def _refused_name(cls: type) -> str | None:
    """The refused algorithm `cls` implements, by the class names along its
    MRO: torch's class, a subclass of it, or another library's class of the
    same name and algorithm (transformers' Adafactor is not torch's)."""
    return next((c.__name__ for c in cls.__mro__ if c.__name__ in _REFUSED), None)


def _holds_a_shard(param_groups) -> bool:
    return any(hasattr(p, SHARD_PID) for group in param_groups for p in group["params"])


def _refusal(optimizer, name: str) -> str:
    """The error for `optimizer`, which implements the refused `name`."""
    cls = type(optimizer)
    who = (f"torch.optim.{name}" if cls is getattr(torch.optim, name, None) else
           f"{cls.__module__}.{cls.__qualname__} ({name})")
    why, instead = _REFUSED[name]
    return (f"sharc: {who} cannot train sharded parameters (after sharc.shard() every "
            f"parameter it holds is this rank's flat 1-D shard): {why}. Instead, {instead}")


def check_step(optimizer) -> None:
    """Raises at a step of a refused optimizer that holds a shard."""
    name = _refused_name(type(optimizer))
    if name is None:
        return
    groups = len(optimizer.param_groups)
    if _NO_SHARD_SEEN.get(optimizer) == groups:
        return
    if _holds_a_shard(optimizer.param_groups):
        raise RuntimeError(_refusal(optimizer, name))
    _NO_SHARD_SEEN[optimizer] = groups


@functools.cache
def install() -> None:
    """Wraps Muon's constructor (once per process): it refuses a non-2-D
    parameter before any step hook runs, with a message that never names
    sharding."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None:
        muon.__init__ = _explain_init_errors(muon.__init__)


def _explain_init_errors(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except ValueError as error:
            # Optimizer.__init__ has set param_groups by the time Muon checks
            # their shapes; an earlier error (a bad lr) has none to look at.
            if not _holds_a_shard(getattr(self, "param_groups", ())):
                raise
            # The type torch raises, so code that catches Muon's error still does.
            raise ValueError(_refusal(self, "Muon")) from error

    return __init__
