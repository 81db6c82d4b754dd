"""When gathered parameters live, for code that no compiled graph covers.

[Note: eager schedule]
Forward. Each module that owns sharded parameters (and the root module) opens
a *scope* for the length of its forward. Reading `module.weight` inside a
scope gathers the parameter (one hold on its runtime buffer) and caches the
full tensor in the innermost scope, so repeated reads in one forward share one
gather; closing the scope drops the holds. Tied parameters and parameters read
by several modules are gathered once per reading scope and freed when the last
hold goes. A read outside every scope (user code between steps) returns a
copy of its own in the master dtype, so nothing stays gathered behind the
user's back. A full tensor the user kept past its scope (`self.kept =
self.weight`, or a view or array of it, which keep it alive) is not freed
under them: its buffer is handed over to those references when the last
hold goes (the runtime tracks the tensors it hands out, weakly) and the
parameter gathers into a fresh buffer next time; sharc warns once per
parameter. A `.detach()` of it is a new tensor the runtime cannot see: kept
alone past the release it reads freed memory, as in compiled graphs, where
`sharc.debug.released_reads_raise` finds such reads.

Backward. While any scope is open, saved-tensor hooks replace every saved
tensor that lives in a gathered buffer by a handle (parameter, size, stride,
offset). Unpacking a handle in backward gathers the parameter again (once per
backward pass) and rebuilds the view. The backward hold is dropped when the
gather's own backward (which hands the gradient to the runtime's eager
reduction) has run, which autograd orders after
every node that used the parameter, or at the end of the backward pass for
parameters without gradients. Nothing full-size therefore survives from
forward to backward, and several backward passes over one forward
(retain_graph=True) each gather what they need.
"""

from __future__ import annotations

import itertools
import warnings

import torch
from torch.utils._pytree import tree_leaves

from sharc import _rank_check
from sharc._param_ref import ShardedParamRef
from sharc._rank_check import RankCheck
from sharc.eager.full_param_access import never_a_frame_of_its_own


class _SavedParam:
    """A saved tensor that is a gathered parameter or a view of it, kept as a
    handle: backward gathers again and takes the same view."""

    __slots__ = ("ref", "size", "stride", "offset")

    def __init__(self, ref: ShardedParamRef, t: torch.Tensor):
        self.ref = ref
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

    __slots__ = ("ref", "views", "copy", "dtype", "size", "stride", "offset")

    def __init__(self, ref: ShardedParamRef, views: tuple, t: torch.Tensor, copy: torch.Tensor):
        self.ref = ref
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
    ref = None if gather is None else gather.metadata.get(_GATHER_TAG)
    copy = t if t._base is None else t._base  # the copy, which t is a view of
    if ref is None or copy.storage_offset() != 0:
        return None
    full = gather._input_metadata[0]  # the gathered parameter: contiguous
    taken = _take_views(torch.empty(list(full.shape), dtype=full.dtype, device="meta"), views)
    if list(taken.shape) != list(copy.shape):
        return None  # t's base is not the copy the chain names: keep t as it is
    return _SavedCopy(ref, views, t, copy)


class GatherUnit:
    """Parameters that every rank gathers, re-gathers for backward and
    reduce-scatters together (ShardConfig.gather_units): one collective each
    at fixed points, whichever of them a rank's data actually uses."""

    __slots__ = ("runtime", "refs", "ids")

    def __init__(self, runtime, refs: list[ShardedParamRef]):
        self.runtime = runtime
        self.refs = refs
        self.ids = [r.pid for r in refs]

    def gather(self) -> None:
        """Blocking: one bucketed all-gather, one hold on each parameter."""
        self.runtime.start_gather(self.ids)
        self.runtime.wait_gather(self.ids)

    def reduce(self) -> None:
        """Blocking: reduce-scatters what backward held back (zeros for what
        this rank never used) and adds it to the shards' gradients."""
        trainable = [r for r in self.refs if r.shard.requires_grad]
        if not trainable:
            return
        grads = self.runtime.flush_unit([r.pid for r in trainable])
        with torch.no_grad():
            for ref, grad in zip(trainable, grads):
                if ref.shard.grad is None:
                    ref.shard.grad = grad
                else:
                    ref.shard.grad += grad


# In-place ops on an OutsideForwardCopy, by name (besides `op_`).
_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                     "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                     "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
_HARMLESS = frozenset({"requires_grad_", "retain_grad", "share_memory_"})


class OutsideForwardCopy(torch.Tensor):
    """What `module.weight` gives outside every forward: a copy of the full
    parameter. Writing to it in place would change the copy only, so it
    raises, naming what does reach the shards. A view of it (`.data`,
    `.detach()`, `view`, indexing) is such a copy too, so writes through it
    raise the same way; a NumPy array of it is beyond reach (writing one
    changes the copy only). Every other op runs as on a tensor and returns
    plain tensors."""

    sharc_fqn = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        in_place = name in _WRITES or (name.endswith("_") and not name.startswith("_")
                                       and name not in _HARMLESS)
        if in_place and args and isinstance(args[0], cls):
            raise RuntimeError(
                f"sharc: '{args[0].sharc_fqn}' read outside forward is a copy of the sharded "
                f"parameter; {name} on it would change the copy only. To change parameters "
                "after sharc.shard(), write them inside `with sharc.unsharded(model, "
                "writeback=True):`, or load them with sharc.load_full_state_dict")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if args and isinstance(args[0], cls):
            return _views_as_copies(out, args[0])
        return out


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


class _Scope:
    __slots__ = ("full",)

    def __init__(self) -> None:
        self.full: dict[int, tuple[ShardedParamRef, torch.Tensor]] = {}


def _skip_as_frames(cls):
    for name in ("forward_pre_hook", "forward_hook"):
        never_a_frame_of_its_own(getattr(cls, name))
    return cls


def _saved_tensor_hooks_active() -> bool:
    """Whether a saved-tensor hook pair (someone else's) is active now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@_skip_as_frames
class EagerSchedule:
    """Gather/release policy for one sharded root module (see the note above)."""

    def __init__(self, refs: list[ShardedParamRef], unit_ids: set[int] = frozenset(),
                 prefetch: bool = True, checks: RankCheck | None = None,
                 reduce_bucket_bytes: int = 4 << 20):
        self._scopes: list[_Scope] = []
        # The runtime decides what to gather ahead and how gradients are
        # reduced, from the events reported here: where each module's
        # forward begins and ends, what backward gathers again, when it ends
        # ([Note: eager prefetch] in core/pass_recording.h, [Note: eager
        # reduction] in runtime/eager_reduction.h).
        self._runtime = refs[0].runtime if refs else None
        self._root = next(_ROOT_KEYS)
        if self._runtime is not None:  # gather units gather on their own
            self._runtime.set_eager_prefetch(self._root, prefetch, sorted(unit_ids))
            self._runtime.set_eager_bucket_bytes(self._root, reduce_bucket_bytes)
        self.checks = checks  # reads outside forward are collective: checked first
        self._saved_hooks = None
        self._delegating_saves = False  # another saved-tensor hook pair is active
        # Base storages are owned by the runtime for the life of the module,
        # so their addresses identify parameters without reuse.
        self._by_storage = {
            r.runtime.padded_base(r.pid).untyped_storage()._cdata: r for r in refs}
        self._backward_full: dict[int, tuple[ShardedParamRef, torch.Tensor]] = {}
        self._units_in_backward: list[GatherUnit] = []
        self._end_of_backward_queued = False
        self._warned_kept: set[int] = set()
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
    @torch.compiler.disable
    def enter_scope(self) -> None:
        if not self._scopes:
            # Saved-tensor hooks do not chain: only the innermost pair sees a
            # save. Where someone else's pair is already active (activation
            # checkpointing recomputing this forward in backward, which must
            # see every save it saw the first time; `save_on_cpu` around the
            # model), sharc leaves every save to it. A gathered parameter
            # saved there lives as long as that pair keeps it, so its buffer
            # is handed over at release (release mode "hand_over"), quietly: that
            # is the pair's design, not a user's kept reference.
            self._delegating_saves = _saved_tensor_hooks_active()
            if not self._delegating_saves:
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(
                    self._pack, self._unpack)
                self._saved_hooks.__enter__()
        self._scopes.append(_Scope())
        if self._runtime is not None:
            self._runtime.enter_module(self._root)

    @torch.compiler.disable
    def exit_scope(self) -> None:
        scope = self._scopes.pop()
        held = [ref for ref, _ in scope.full.values()]
        scope.full.clear()  # before releasing: only references from outside remain
        for ref in held:
            self._let_go(ref)
        if self._runtime is not None:
            self._runtime.exit_module()
        if not self._scopes:
            self._delegating_saves = False
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None

    @torch.compiler.disable
    def read(self, ref: ShardedParamRef) -> torch.Tensor:
        """The full tensor for `module.<name>`."""
        if self.unsharded is not None:
            return self.unsharded[ref.pid]
        if not self._scopes:  # a copy of its own, in the master dtype
            if self.checks is not None:
                self.checks.agree(_rank_check.OUTSIDE_READ, f"'{ref.fqn}'", ref.pid)
            copy = ref.all_gather_op().as_subclass(OutsideForwardCopy)
            copy.sharc_fqn = ref.fqn
            return copy
        scope = self._scopes[-1]
        cached = scope.full.get(ref.pid)
        if cached is not None:
            return cached[1]
        full = ref.gather_op()
        scope.full[ref.pid] = (ref, full)
        if full.grad_fn is not None:
            full.grad_fn.metadata[_GATHER_TAG] = ref
            full.grad_fn.register_hook(lambda *_: self._release_backward(ref.pid))
        return full

    # -- gather units ---------------------------------------------------
    # Eager even inside compiled frames (a graph break at each unit): the
    # unit's collectives must run on every rank at the same point.
    @torch.compiler.disable
    def enter_unit(self, unit: GatherUnit) -> None:
        unit.gather()

    @torch.compiler.disable
    def exit_unit(self, unit: GatherUnit, output) -> None:
        self._release_unit(unit)
        outputs = [t for t in tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda *_: self._unit_backward(unit), mode="any")

    def _unit_backward(self, unit: GatherUnit) -> None:
        """The unit's output gradient arrived: gather it whole for its
        backward; it is reduced and released at the end of backward."""
        if unit in self._units_in_backward:
            return
        unit.gather()
        self._units_in_backward.append(unit)
        self._queue_end_of_backward()

    # -- backward -------------------------------------------------------
    @torch.compiler.disable
    def _pack(self, t: torch.Tensor):
        ref = self._by_storage.get(t.untyped_storage()._cdata)
        if ref is not None:
            return _SavedParam(ref, t)
        handle = _saved_copy(t) if t.grad_fn is not None else None
        return t if handle is None else handle

    @torch.compiler.disable
    def _unpack(self, saved):
        if not isinstance(saved, (_SavedParam, _SavedCopy)):
            return saved
        return saved.rebuild(self._gather_for_backward(saved.ref))

    def _gather_for_backward(self, ref: ShardedParamRef) -> torch.Tensor:
        entry = self._backward_full.get(ref.pid)
        if entry is None:
            entry = (ref, ref.runtime.gather_for_backward(self._root, ref.pid))
            self._backward_full[ref.pid] = entry
            self._queue_end_of_backward()
        return entry[1]

    def _release_backward(self, pid: int) -> None:
        entry = self._backward_full.pop(pid, None)
        if entry is not None:
            ref = entry[0]
            del entry  # only references from outside may remain
            self._let_go(ref)

    def _queue_end_of_backward(self) -> None:
        if self._end_of_backward_queued:
            return
        self._end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        units, self._units_in_backward = self._units_in_backward, []
        for unit in units:  # in the same order on every rank
            unit.reduce()
            self._release_unit(unit)
        for pid in list(self._backward_full):
            self._release_backward(pid)
        if self._runtime is not None:
            self._runtime.end_eager_backward(self._root)

    # -- letting go -----------------------------------------------------
    def _release_unit(self, unit: GatherUnit) -> None:
        for ref in unit.refs:
            self._let_go(ref)

    def _rekey_base(self, ref: ShardedParamRef) -> None:
        """The parameter got a fresh base buffer: key it by the new storage."""
        self._by_storage = {k: r for k, r in self._by_storage.items() if r is not ref}
        self._by_storage[ref.runtime.padded_base(ref.pid).untyped_storage()._cdata] = ref

    def _let_go(self, ref: ShardedParamRef) -> None:
        """Drops one hold. A buffer something outside still references when
        its last hold goes (a kept `module.weight`, a view, a numpy array) is
        handed to those references rather than freed under them."""
        if self._delegating_saves:
            if ref.runtime.release(ref.pid, "hand_over"):
                self._rekey_base(ref)
            return
        if not ref.runtime.release(ref.pid, "free_or_hand_over"):
            return
        self._rekey_base(ref)
        if ref.pid not in self._warned_kept:
            self._warned_kept.add(ref.pid)
            warnings.warn(
                f"sharc: the gathered parameter '{ref.fqn}' was still referenced when "
                "sharc released it (a `module.weight` kept past its module's forward, or a "
                "view or array of it). That reference keeps the values of that gather, "
                "and their memory, until it is dropped; it does not follow later updates. "
                "Read the module attribute again instead of keeping it.", stacklevel=2)
