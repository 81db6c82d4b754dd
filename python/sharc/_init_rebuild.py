"""Modules that give their parameters values in `__init__` itself, with no
`reset_parameters()` to do it again: the replay builds the module again
from its constructor arguments (see [Note: init replay] in materialize.py).

transformers' `Conv1D` (GPT-2's projections) draws its weight with
`nn.init.normal_` in its `__init__`. Built normally, those draws happen
where the module is built and move the random stream for everything built
after it (a `post_init()` then overwrites the values, but the stream has
moved); on the meta device they draw nothing. The replay can only draw
them again by running that `__init__` again, so, at the module's place in
construction order, it builds a twin of it on the shards' device and takes
its parameters' and buffers' values.

Only a leaf (a module without submodules: a twin of a parent would build,
and draw, its children again) whose constructor arguments can be read back:
every named argument of its class's `__init__` kept as an attribute of the
same name (`self.nf = nf`), `*args`/`**kwargs` taken as empty. A twin laid
out otherwise than the module (parameter and buffer names, shapes, dtypes)
is refused. Whether `__init__` wrote a parameter at all shows on the meta
model: an in-place write (`normal_`, `fill_`) moved the meta parameter's
version counter, which shard() records (`PendingInit.written_when_built`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re

import torch

from sharc._state import state_of


class Plan:
    """How to build a twin of one module: its class and arguments."""

    def __init__(self, cls: type, kwargs: dict, dtype: torch.dtype | None):
        self.cls = cls
        self.kwargs = kwargs
        self.dtype = dtype  # the default dtype to build under (None: as it is)

    def build(self, device) -> torch.nn.Module:
        with torch.device(device), _default_dtype(self.dtype):
            return self.cls(**self.kwargs)


def original_class(module: torch.nn.Module) -> type:
    return getattr(module, "_sharc_original_class", type(module))


def plan(module: torch.nn.Module) -> tuple[Plan | None, str]:
    """A plan for a twin of `module` checked on the meta device (layout as
    the module's), or None and why not (a sentence for an error message)."""
    cls = original_class(module)
    if next(module.children(), None) is not None:
        return None, (f"{cls.__name__} has submodules, which a second build would "
                      "initialise again")
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None, f"the arguments of {cls.__name__}.__init__ cannot be read"
    attributes = vars(module)
    kwargs = {}
    for name, arg in list(signature.parameters.items())[1:]:  # after self
        if arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        if name not in attributes or name.startswith("_"):
            return None, (f"its __init__ argument '{name}' is not kept as an attribute of "
                          "the same name, so sharc cannot build it again")
        if arg.kind is arg.POSITIONAL_ONLY:
            return None, f"its __init__ argument '{name}' is positional-only"
        kwargs[name] = attributes[name]
    # Built under the default dtype as it is now, else under the one the
    # module's parameters have (a model built under another default dtype).
    for dtype in dict.fromkeys((None, _param_dtype(module))):
        twin_plan = Plan(cls, kwargs, dtype)
        try:
            twin = twin_plan.build("meta")
        except Exception as e:  # noqa: BLE001  (any failure means: cannot rebuild)
            return None, (f"building {cls.__name__}(**{_short(kwargs)}) again from its "
                          f"attributes failed ({type(e).__name__}: {e})")
        if _layout_of_twin(twin) == _layout(module):
            return twin_plan, ""
    return None, (f"{cls.__name__}(**{_short(kwargs)}), built again from its attributes, "
                  "has other parameters or buffers than the module")


def copy_from_twin(twin_plan: Plan, module: torch.nn.Module, device) -> None:
    """The initialiser of `module` on its unit (its parameters full-size in
    `module._parameters`): builds the twin, drawing what the module's
    `__init__` drew, and takes its values."""
    twin = twin_plan.build(device)
    state = state_of(module)
    for local in (state.refs if state is not None else ()):
        module._parameters[local].copy_(twin._parameters[local])
    for local, buffer in module._buffers.items():
        if buffer is not None:
            buffer.copy_(twin._buffers[local])


def _param_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The default dtype the module was built under, as far as its first
    floating parameter tells."""
    state = state_of(module)
    for ref in (state.refs.values() if state is not None else ()):
        if ref.shard.dtype.is_floating_point:
            return ref.shard.dtype
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _layout(module: torch.nn.Module):
    state = state_of(module)
    params = {local: (tuple(ref.shape), ref.shard.dtype)
              for local, ref in (state.refs.items() if state is not None else ())}
    return params, _buffers(module)


def _layout_of_twin(twin: torch.nn.Module):
    params = {local: (tuple(p.shape), p.dtype)
              for local, p in twin._parameters.items() if p is not None}
    return params, _buffers(twin)


def _buffers(module: torch.nn.Module):
    return {local: (tuple(b.shape), b.dtype) for local, b in module._buffers.items()
            if b is not None}


def _short(kwargs: dict) -> str:
    text = repr(kwargs)
    return text if len(text) <= 80 else text[:77] + "..."


# Random draws as written in source: torch's random factories, in-place
# random fills and nn.init's random initialisers.
_DRAW = re.compile(
    r"\btorch\.(randn|rand|randint|randperm|normal|bernoulli|multinomial)\s*\("
    r"|\.(normal_|uniform_|bernoulli_|random_|exponential_|cauchy_|log_normal_|geometric_)\s*\("
    r"|(?<![\w.])(?:init\.)?(normal|uniform|trunc_normal|kaiming_normal|kaiming_uniform"
    r"|xavier_normal|xavier_uniform|orthogonal|sparse)_\s*\(")  # bare: `from torch.nn.init import`


def draw_in_init(module: torch.nn.Module) -> str | None:
    """The first line of the module's class's own `__init__` source (or of a
    base class's, up to torch's) that draws random numbers, or None. Such a
    draw on the meta device leaves no trace on the tensor it makes
    (`nn.Parameter(torch.randn(n))`), so only the source tells."""
    return _draw_in_class_init(original_class(module))


@functools.lru_cache(maxsize=None)
def _draw_in_class_init(cls: type) -> str | None:
    """draw_in_init, once per class (a model repeats its layers' classes)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "transformers.modeling_utils")):
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            lines = inspect.getsource(init).splitlines()
        except (OSError, TypeError):
            continue
        for line in lines:
            if _DRAW.search(line.split("#")[0]):
                return line.strip()
    return None
