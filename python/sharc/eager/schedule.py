"""When gathered parameters live, for code that no compiled graph covers.

[Note: eager schedule]
The decisions are the runtime's (`EagerScope`, [Note: eager holds] in
src/runtime/eager_scope.h and include/sharc/core/eager_holds.h); this file
reports events to it and hands tensors through.

Forward. Each module that owns sharded parameters (and the root module)
reports where its forward begins and ends (a *scope*). Reading
`module.weight` inside a scope asks the runtime, which gathers once per
scope, holds the parameter until the scope closes and hands back the same
full tensor for every read there. A read outside every scope (user code
between steps) returns a copy of its own in the master dtype, so nothing
stays gathered behind the user's back. A full tensor the user kept past its
scope (`self.kept = self.weight`, or a view or array of it) is not freed
under them: the runtime hands its buffer over to those references and
warns once per parameter. A `.detach()` of it is a new tensor the runtime
cannot see: kept alone past the release it reads freed memory, as in
compiled graphs, where `sharc.debug.released_reads_raise` finds such reads.

Backward. While any scope is open, saved-tensor hooks replace every saved
tensor that lives in a gathered buffer (the runtime tells which) by a handle
(parameter, size, stride, offset), and a cast or copy of a gathered
parameter by a handle that replays its views (`_SavedCopy`). Unpacking a
handle asks the runtime for the parameter, which gathers it again once per
backward pass and drops that hold when the gather's own backward has run, or
at the end of the backward pass (its one end-of-backward callback). Nothing
full-size therefore survives from forward to backward, and several backward
passes over one forward (retain_graph=True) each gather what they need.

Why the saved-copy walk stays here: it reads what autograd's generated
nodes saved (`_saved_dim`, `_saved_start`, ...) and replays the views with
tensor methods. Python sees those attributes under stable names in every
torch release; in C++ they are fields of generated structs that differ
between releases (sharc builds against several). Saved-tensor hooks are
Python callables in any case.
"""

from __future__ import annotations

import functools
import itertools
import re

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from sharc import _rank_check
from sharc._param_ref import ShardedParamRef
from sharc._rank_check import RankCheck
from sharc.eager.full_param_access import never_a_frame_of_its_own


class _SavedParam:
    """A saved tensor that is a gathered parameter or a view of it, kept as a
    handle: backward gathers again and takes the same view."""

    __slots__ = ("owner", "pid", "size", "stride", "offset")

    def __init__(self, owner: EagerSchedule, pid: int, t: torch.Tensor):
        self.owner = owner  # the schedule whose runtime gathers it again
        self.pid = pid
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def rebuild(self, full: torch.Tensor) -> torch.Tensor:
        return full.as_strided(self.size, self.stride, self.offset)


class _SavedCopy:
    """A saved tensor that is (a view of) a cast or copy of a gathered
    parameter or of a view of it (what autocast saves for `x @ w.t()`), kept
    as a handle: backward gathers again, takes the views the copy read
    (`views`), copies them into a tensor laid out as the copy was, in its
    dtype, and takes the saved tensor's view of that."""

    __slots__ = ("owner", "pid", "views", "copy", "dtype", "size", "stride", "offset")

    def __init__(self, tag: tuple, views: tuple, t: torch.Tensor, copy: torch.Tensor):
        self.owner, self.pid = tag  # what the read tagged the gather node with
        self.views = views
        self.copy = (copy.size(), copy.stride())
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def rebuild(self, full: torch.Tensor) -> torch.Tensor:
        copy = torch.empty_strided(*self.copy, dtype=self.dtype, device=full.device)
        copy.copy_(_take_views(full, self.views))
        return copy.as_strided(self.size, self.stride, self.offset)


# Autograd nodes of value-preserving ops a saved tensor may sit behind, each
# with how to take its view again on a freshly gathered parameter: from what
# the node saved and the view's shape (the node's input metadata).
_VIEW_NODES = {
    "AliasBackward0": lambda n, shape: ("view", shape),
    "AsStridedBackward0": lambda n, shape: (
        "as_strided", n._saved_size, n._saved_stride, n._saved_storage_offset),
    "ExpandBackward0": lambda n, shape: ("expand", shape),
    "PermuteBackward0": lambda n, shape: ("permute", n._saved_dims),
    "SelectBackward0": lambda n, shape: ("select", n._saved_dim, n._saved_index),
    "SliceBackward0": lambda n, shape: (
        "slice", n._saved_dim, n._saved_start, n._saved_end, n._saved_step),
    "SqueezeBackward0": lambda n, shape: ("view", shape),
    "SqueezeBackward1": lambda n, shape: ("view", shape),
    "TBackward0": lambda n, shape: ("t",),
    "TransposeBackward0": lambda n, shape: ("transpose", n._saved_dim0, n._saved_dim1),
    "UnsafeViewBackward0": lambda n, shape: ("view", shape),
    "UnsqueezeBackward0": lambda n, shape: ("view", shape),
    "ViewBackward0": lambda n, shape: ("view", shape),
}
_COPY_NODES = frozenset({"ToCopyBackward0", "CloneBackward0"})
_GATHER_TAG = "sharc_gathered_param"
# Each sharded root's key in its runtime (the eager prefetch's order is
# kept per root).
_ROOT_KEYS = itertools.count()


def _take_views(t: torch.Tensor, views: tuple) -> torch.Tensor:
    for op, *args in views:
        t = torch.ops.aten.slice.Tensor(t, *args) if op == "slice" else getattr(t, op)(*args)
    return t


def _views_up_to(node) -> tuple[object, tuple]:
    """The first node from `node` up that is not a view, and the views on
    the way, in the order forward took them."""
    views = []
    while node is not None and type(node).__name__ in _VIEW_NODES:
        views.append(_VIEW_NODES[type(node).__name__](
            node, list(node._input_metadata[0].shape)))
        node = node.next_functions[0][0]
    return node, tuple(reversed(views))


def _saved_copy(t: torch.Tensor) -> _SavedCopy | None:
    """A handle for `t` if it is derived from a gathered parameter by views,
    one cast or copy and views again (what autocast saves for backward);
    None for anything else. (Views of the parameter itself share its storage
    and are recognised by that.)"""
    node = t.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ not in _COPY_NODES:
        return None
    gather, views = _views_up_to(node.next_functions[0][0])
    tag = None if gather is None else gather.metadata.get(_GATHER_TAG)
    copy = t if t._base is None else t._base  # the copy, which t is a view of
    if tag is None or copy.storage_offset() != 0:
        return None
    full = gather._input_metadata[0]  # the gathered parameter: contiguous
    taken = _take_views(torch.empty(list(full.shape), dtype=full.dtype, device="meta"), views)
    if list(taken.shape) != list(copy.shape):
        return None  # t's base is not the copy the chain names: keep t as it is
    return _SavedCopy(tag, views, t, copy)


# In-place ops on an OutsideForwardCopy, by name (besides `op_`).
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                     "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                     "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
_HARMLESS = frozenset({"share_memory_"})
# What each gradient access on an OutsideForwardCopy would do there, by name
# ([Note: a copy has no gradient of training's]).
_GRADIENT_ACCESSES = {
    "register_hook": ("a hook registered on it", "would see only gradients that flow "
                      "through this copy, never the model's"),
    "register_post_accumulate_grad_hook": ("a hook registered on it", "would never be called "
                                           "(the copy is no leaf: nothing accumulates there)"),
    "retain_grad": ("retain_grad() on it", "would keep only gradients that flow through this "
                    "copy, never the model's"),
    "grad.__set__": ("assigning its `.grad`", "would set a gradient no optimizer sees"),
    "grad.__get__": ("its `.grad`", "is None whatever backward computed"),
    "backward(inputs=...)": ("naming it in backward(inputs=...)", "would stop backward at this "
                             "copy, so no gradient reaches the shard (nothing trains)"),
    "autograd.grad": ("torch.autograd.grad with respect to it", "finds no gradient: forward "
                      "reads the parameter anew, never this copy"),
}


def _autograd_call_on_copies(cls, func, args, kwargs):
    """torch.autograd.backward or torch.autograd.grad given a copy among
    their `inputs` (torch hands both to __torch_function__ then, `inputs`
    as a tuple): `loss.backward(inputs=[model.fc.weight])` would leave every
    gradient None, silently, and `autograd.grad(loss, model.fc.weight)`
    fail with torch's "appears to not have been used in the graph" (or give
    None under allow_unused=True); each raises naming the shard instead. A
    gradient with respect to a copy that the differentiated outputs were
    computed from (a penalty on `model.fc.weight`) is returned as usual."""
    if func is torch.autograd.backward:
        copy = next((t for t in kwargs.get("inputs") or () if isinstance(t, cls)), None)
        if copy is not None:
            raise _gradient_access_refused(copy, "backward(inputs=...)")
        return None
    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    with torch._C.DisableTorchFunctionSubclass():
        try:
            grads = func(*args, **kwargs)
        except RuntimeError as e:
            unused = re.search(r"Tensor at index (\d+) appears to not have been used", str(e))
            copy = inputs[int(unused.group(1))] if unused else None
            if isinstance(copy, cls):
                raise _gradient_access_refused(copy, "autograd.grad") from e
            raise
    for t, g in zip(inputs, grads):
        if g is None and isinstance(t, cls):
            raise _gradient_access_refused(t, "autograd.grad")
    return grads


def _sets_attribute(func, name: str, attribute: str) -> bool:
    """Whether `func` is the setter of the tensor attribute `attribute`
    (`w.<attribute> = ...` reaches __torch_function__ as its `__set__`)."""
    return name == "__set__" and _attribute_of(func) == attribute


def _attribute_of(func) -> str:
    """The tensor attribute whose getter or setter `func` is, or ''."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _reads_base(func, name: str) -> bool:
    """`w._base`. The copy is itself a view (of the gathered tensor it was
    made from), so its base, made a copy in turn, would be another view of
    it, without end: Dynamo and torch.export follow `_base` until it is
    None, and a copy handed to a compiled function ran into a RecursionError.
    The base is left a plain tensor (`_base` is private: writes through it
    go unseen, as through a NumPy array of the copy)."""
    return name == "__get__" and _attribute_of(func) == "_base"


def _gradient_access(func, name: str) -> str | None:
    """The key of `_GRADIENT_ACCESSES` that `func` is, or None.

    A read of `.grad` while torch traces is torch's own, not the user's:
    Dynamo and torch.export read `.grad` of every tensor they make a fake
    tensor of (a copy handed to a compiled function), and must see None
    there, as for any tensor that is no leaf."""
    if name in ("__get__", "__set__") and _attribute_of(func) == "grad":
        tracing = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
        return None if name == "__get__" and tracing else f"grad.{name}"
    return name if name in _GRADIENT_ACCESSES else None


def _gradient_access_refused(copy: "OutsideForwardCopy", access: str) -> RuntimeError:
    """[Note: a copy has no gradient of training's]
    The copy is a tensor of its own, gathered for one read. Forward reads
    the parameter anew, so backward reaches the copy only through what the
    user computed from it (a penalty on `model.fc.weight`), and the model's
    gradient lands in the shard's `.grad` (reduce-scattered, averaged). A
    hook, retain_grad() or an assigned `.grad` on the copy would silently
    miss that gradient, so each raises, naming where it is. A read of
    `.grad` raises too, rather than give None: `model.fc.weight.grad.norm()`
    would fail far from the cause, and torch.nn.utils.clip_grad_norm_ given
    copies would clip nothing, silently. Nothing in torch or transformers
    reads `.grad` of a module's attribute outside forward (optimizers,
    clipping and trainers go through `parameters()`, the shards), except
    torch's tracing, which is let through (see _gradient_access)."""
    what, effect = _GRADIENT_ACCESSES[access]
    fqn = copy.sharc_fqn
    return RuntimeError(
        f"sharc: '{fqn}' read outside forward is a copy of the sharded parameter, gathered "
        f"for this read, apart from what forward and backward use; {what} {effect}. The "
        "gradient lives on the shard the optimizer holds: "
        f"`dict(model.named_parameters())['{fqn}'].grad` is this rank's flat shard of the "
        "averaged gradient (register gradient hooks on that shard), "
        "sharc.clip_grad_norm_(model, max_norm) returns the norm of the whole gradient, and "
        "inside `with sharc.unsharded(model, with_grads=True):` (on every rank) that "
        "same `.grad` is the whole gradient")


def _sets_requires_grad(func, name: str) -> bool:
    """`w.requires_grad_(...)` or `w.requires_grad = ...`."""
    return name == "requires_grad_" or _sets_attribute(func, name, "requires_grad")


def _copy_write_refused(copy: "OutsideForwardCopy", what: str) -> RuntimeError:
    """The error for a write (`what`) to a copy read outside forward."""
    return RuntimeError(
        f"sharc: '{copy.sharc_fqn}' read outside forward is a copy of the sharded "
        f"parameter; {what} on it would change the copy only. To change parameters "
        "after sharc.shard(), write them inside `with sharc.unsharded(model, "
        "writeback=True):`, or load them with sharc.load_full_state_dict")


def _data_assignment_refused(copy: "OutsideForwardCopy", new) -> RuntimeError:
    """`w.data = new` swaps the copy's storage (transformers'
    resize_token_embeddings does it); the shards never see it."""
    error = _copy_write_refused(copy, "assigning `.data`")
    if not isinstance(new, torch.Tensor) or new.shape == copy.shape:
        return error
    # unsharded() would refuse it too: shard() fixed every parameter's shape.
    return RuntimeError(
        f"{error}. The new shape ({list(new.shape)} for {list(copy.shape)}) cannot reach "
        "the shards that way either: change shapes (resize_token_embeddings "
        "included) before sharc.shard()")


class OutsideForwardCopy(torch.Tensor):
    """What `module.weight` gives outside every forward, and each parameter's
    entry of `module.state_dict()`: a copy of the full parameter. Writing to it in place (or assigning its `.data`) would
    change the copy only, so it raises, naming what does reach the shards. A view of it (`.data`,
    `.detach()`, `view`, indexing) is such a copy too, so writes through it
    raise the same way; a NumPy array of it is beyond reach (writing one
    changes the copy only). Gradient hooks, retain_grad() and `.grad` on it
    raise too, naming the shard that holds the gradient ([Note: a copy has
    no gradient of training's]). Every other op runs as on a tensor and
    returns plain tensors."""

    sharc_fqn = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__reduce_ex__:
            # Pickled (torch.save of a state_dict) as the plain tensor it copies,
            # so the file loads without sharc, weights_only=True included.
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].detach().as_subclass(torch.Tensor).__reduce_ex__(*args[1:])
        if func is torch.Tensor.__deepcopy__:
            # A tensor of the caller's own (a snapshot of a state_dict): plain, writable.
            with torch._C.DisableTorchFunctionSubclass():
                new = args[0].detach().as_subclass(torch.Tensor).clone()
            memo = args[1] if len(args) > 1 else (kwargs or {}).get("memo")
            if memo is not None:
                memo[id(args[0])] = new
            return new
        if func is torch.autograd.backward or func is torch.autograd.grad:
            grads = _autograd_call_on_copies(cls, func, args, kwargs or {})
            if func is torch.autograd.grad:
                return grads
        name = getattr(func, "__name__", "")
        in_place = name in _WRITES or (name.endswith("_") and not name.startswith("_")
                                       and name not in _HARMLESS)
        target = _first_tensor(args, kwargs)
        if name.startswith("_foreach_") and name.endswith("_"):
            # torch._foreach_lerp_(ema.state_dict().values(), ...) (timm's
            # ModelEmaV3) writes every tensor of its first list.
            written = args[0] if args else (kwargs or {}).get("self")
            in_place, target = True, _first_copy_among(cls, written)
        if isinstance((kwargs or {}).get("out"), cls):  # torch.eye(n, out=w): a write too
            in_place, target = True, kwargs["out"]
        if isinstance(target, cls) and _sets_requires_grad(func, name):
            # On the copy it would freeze or unfreeze nothing that trains.
            raise RuntimeError(
                f"sharc: '{target.sharc_fqn}' read outside forward is a copy of the sharded "
                "parameter; freezing or unfreezing it would change the copy only. Set "
                "requires_grad on the shard the optimizer holds: "
                "`for p in module.parameters(): p.requires_grad_(flag)`, or "
                f"`dict(model.named_parameters())['{target.sharc_fqn}'].requires_grad_(flag)`")
        access = _gradient_access(func, name) if isinstance(target, cls) else None
        if access is not None:
            raise _gradient_access_refused(target, access)
        if isinstance(target, cls) and _sets_attribute(func, name, "data"):
            raise _data_assignment_refused(target, args[1])
        if in_place and isinstance(target, cls):
            raise _copy_write_refused(target, name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if isinstance(target, cls) and not _reads_base(func, name):
            return _views_as_copies(out, target)
        return out


def outside_forward_copy(full: torch.Tensor, fqn: str) -> OutsideForwardCopy:
    """`full`, a gathered copy of parameter `fqn`, as an OutsideForwardCopy."""
    copy = full.as_subclass(OutsideForwardCopy)
    copy.sharc_fqn = fqn
    return copy


def _first_tensor(args, kwargs):
    """The tensor an op acts on: its first argument, or, where every
    argument came by keyword (torch.nn.init's functions hand theirs over as
    `tensor=`), the first tensor among them."""
    if args:
        return args[0]
    return next((v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)), None)


def _first_copy_among(cls, tensors):
    """The first OutsideForwardCopy in a foreach op's list, or None."""
    if isinstance(tensors, (list, tuple)):
        return next((t for t in tensors if isinstance(t, cls)), None)
    return None


def _views_as_copies(out, copy: OutsideForwardCopy):
    """`out` with every tensor in it that shares `copy`'s storage (a view)
    made an OutsideForwardCopy of the same parameter."""
    if isinstance(out, (tuple, list)):
        return type(out)(_views_as_copies(o, copy) for o in out)
    if (not isinstance(out, torch.Tensor) or isinstance(out, OutsideForwardCopy)
            or out.layout != torch.strided  # sparse results have no storage to share
            or out.untyped_storage().data_ptr() != copy.untyped_storage().data_ptr()):
        return out
    view = out.as_subclass(OutsideForwardCopy)
    view.sharc_fqn = copy.sharc_fqn
    return view


def _eager_runtime_call(fn):
    """An eager schedule method that calls into the runtime: never traced
    (compiled frames capture reads as gathers instead; one that still
    reaches it runs eagerly at a graph break, so every gather is matched by
    its release), and run outside the user's dispatch modes.

    [Note: sharc's own ops and the user's dispatch modes]
    The runtime's gathers, views, copies and releases in forward and at
    unpacking are sharc's, not the model's. Selective activation
    checkpointing's mode records the first forward's ops and replays them
    in order when backward recomputes it, and the recompute releases by
    another path (buffers handed over to the first forward's saves), so an
    op seen only then failed the replay ("encountered during backward but
    not found in storage"). The model's own ops on the tensors sharc hands
    back are still seen. The check reads torch's dispatch-mode stack only
    (not the pre-dispatch one, which these calls never meet)."""
    @functools.wraps(fn)
    def outside_modes(*args, **kwargs):
        if torch._C._len_torch_dispatch_stack() == 0:
            return fn(*args, **kwargs)
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return torch.compiler.disable(outside_modes)


def _skip_as_frames(cls):
    for name in ("forward_pre_hook", "forward_hook"):
        never_a_frame_of_its_own(getattr(cls, name))
    return cls


def _saved_tensor_hooks_active() -> bool:
    """Whether a saved-tensor hook pair (someone else's) is active now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@_skip_as_frames
class EagerSchedule:
    """The eager path's events for one sharded root module, reported to the
    runtime, which decides what is gathered, held and released (see the
    note above)."""

    def __init__(self, refs: list[ShardedParamRef], unit_ids: set[int] = frozenset(),
                 prefetch: bool = True, checks: RankCheck | None = None,
                 reduce_bucket_bytes: int = 4 << 20, tied_ids: set[int] = frozenset()):
        self._runtime = refs[0].runtime if refs else None
        self._root = next(_ROOT_KEYS)
        # The saved-tensor handles keep this schedule, and through it the
        # shards they gather again in backward, alive: a backward may outlive
        # the model (`loss = model(x); del model; loss.backward()`), and a
        # dead shard is given back ([Note: retired parameters]).
        self._shards = tuple(r.shard for r in refs)
        if self._runtime is not None:  # gather units gather on their own
            # Tied parameters are held for the whole forward pass (see
            # [Note: eager holds]).
            self._runtime.eager_add_root(self._root, [r.pid for r in refs], sorted(tied_ids))
            self._runtime.set_eager_prefetch(self._root, prefetch, sorted(unit_ids))
            self._runtime.set_eager_bucket_bytes(self._root, reduce_bucket_bytes)
        self.checks = checks  # reads outside forward are collective: checked first
        self._saved_hooks = None  # sharc's saved-tensor hook pair, while pushed
        # While sharc's own code reads the shards by module.state_dict().
        self.raw_state_dict = False
        # sharc.unsharded(): parameter id -> the full tensor every read gives.
        self.unsharded: dict[int, torch.Tensor] | None = None

    # -- forward scopes -------------------------------------------------
    # Inside a compiled frame the module hooks do nothing: reads are captured
    # as all-gathers that the compiled graph schedules itself.
    def forward_pre_hook(self, *_) -> None:
        if not torch.compiler.is_compiling():
            self.enter_scope()

    def forward_hook(self, *_) -> None:
        if not torch.compiler.is_compiling():
            self.exit_scope()

    # Compiled frames never call these (the hooks above and the parameter
    # property check torch.compiler.is_compiling() first); should one still
    # reach them, it runs them eagerly at a graph break, so every gather is
    # still matched by its release.
    @_eager_runtime_call
    def enter_scope(self) -> None:
        if self._runtime is None:
            return
        # Saved-tensor hooks do not chain: only the innermost pair sees a
        # save. Where someone else's pair is already active when the
        # outermost scope opens (activation checkpointing recomputing this
        # forward in backward, which must see every save it saw the first
        # time; `save_on_cpu` around the model), sharc leaves every save to
        # it, and the runtime hands buffers over at release.
        elsewhere = self._saved_hooks is None and _saved_tensor_hooks_active()
        if self._runtime.eager_enter(self._root, elsewhere) and not elsewhere:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()  # kept only once entered: exit_scope pops what is kept
            self._saved_hooks = hooks

    @_eager_runtime_call
    def exit_scope(self) -> None:
        if self._runtime is None:
            return
        if self._runtime.eager_exit(self._root) and self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    @_eager_runtime_call
    def read(self, ref: ShardedParamRef, module: torch.nn.Module | None = None) -> torch.Tensor:
        """The full tensor for `module.<name>`."""
        if self.unsharded is not None:
            through = getattr(self.unsharded, "read_through", None)
            return self.unsharded[ref.pid] if through is None else through(module, ref.pid)
        full, fresh = self._runtime.eager_read(self._root, ref.pid, ref.shard)
        if full is None:  # outside every scope: a copy of its own, in the master dtype
            if self.checks is not None:
                self.checks.agree(_rank_check.OUTSIDE_READ, f"'{ref.fqn}'", ref.pid)
            return outside_forward_copy(ref.all_gather_op(), ref.fqn)
        if fresh and full.grad_fn is not None:  # for _saved_copy
            full.grad_fn.metadata[_GATHER_TAG] = (self, ref.pid)
        return full

    # -- gather units ---------------------------------------------------
    def add_unit(self, refs: list[ShardedParamRef], keep: bool = False) -> int:
        """A gather unit's parameters; returns its index for the hooks.
        `keep`: gathered from its forward to its backward (small units)."""
        return self._runtime.eager_add_unit(self._root, [r.pid for r in refs],
                                            [r.shard for r in refs], keep)

    # Eager even inside compiled frames (a graph break at each unit): the
    # unit's collectives must run on every rank at the same point.
    @_eager_runtime_call
    def enter_unit(self, unit: int) -> None:
        self._runtime.eager_enter_unit(self._root, unit)

    @_eager_runtime_call
    def exit_unit(self, unit: int, output) -> None:
        outputs = [t for t in tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        for_backward = bool(outputs) and torch.is_grad_enabled()
        self._runtime.eager_exit_unit(self._root, unit, for_backward)
        if for_backward:
            # The gradient of the unit's output arrived: the runtime gathers
            # the unit for its backward and reduces it at the end of backward.
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda *_: self._runtime.eager_unit_backward(self._root, unit),
                mode="any")

    # -- backward -------------------------------------------------------
    @_eager_runtime_call
    def _pack(self, t: torch.Tensor):
        pid = self._runtime.eager_saved_param(self._root, t)
        if pid >= 0:
            return _SavedParam(self, pid, t)
        handle = _saved_copy(t) if t.grad_fn is not None else None
        return t if handle is None else handle

    @_eager_runtime_call
    def _unpack(self, saved):
        if not isinstance(saved, (_SavedParam, _SavedCopy)):
            return saved
        owner = saved.owner
        if torch.is_grad_enabled():
            # A backward with create_graph=True: its formulas would save the
            # parameter gathered for this backward, which is freed right after
            # it, and differentiate through a read autograd cannot see.
            raise RuntimeError(
                "sharc: a backward with create_graph=True (a double backward: a gradient "
                f"penalty, a Hessian-vector product) reached the sharded parameter "
                f"'{owner._runtime.name(saved.pid)}'. Differentiating a gradient through "
                "sharded parameters is not supported (torch.compile refuses double backward as "
                "well); compute the penalty's gradient without create_graph=True")
        return saved.rebuild(owner._runtime.eager_unpack(owner._root, saved.pid))
