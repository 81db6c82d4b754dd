"""Measures what each compute node of a graph costs, for the scheduler.

In the first compile, each call_function node of an AOTAutograd graph runs
alone on stand-in inputs built from its inputs' recorded values (shape,
stride, dtype, device): floats random from a generator of its own, integers
and bools zero (so index ops stay in range). One warm-up run, then the
median of a few, synchronized on a device. Nothing real is touched: the
stand-ins are fresh tensors and the global RNG state is restored after, so
the step computes what it would have without profiling.

The costs are this rank's own, and profiling issues no collective: a graph
may be compiled on some ranks only (a recompile after a guard failed on
one rank's data), and a collective there would pair with whatever the
other ranks do next. So no pass that decides which collectives run may
read compute costs; those decisions read only what every rank agreed on
when the group's collective costs were measured (see schedule.py).

Under dynamic shapes a node runs at its sizes' hints: the sizes the graph
was traced with, so the first concrete sizes it met. A later, larger size
takes longer than measured; the costs only order the scheduler's choices
of how early a gather starts, never which collectives run.

Each distinct call (operator, and its inputs' sizes, strides, dtypes and
devices, and its other arguments) is measured once: the identical blocks
of a model, the blocks of a model compiled one by one, and a recompile all
reuse what was measured (`CostCache`), and so does a later process of the
same job on this host, from the file the process's cache keeps beside
Inductor's cache (cost_store.py): it then schedules as this one did and
finds its graphs in Inductor's FX graph cache. One file per rank: each
rank schedules from its own costs, and a rank reading another's would
schedule differently from its own earlier run.

Not measured (no cost): sharc's own ops and collectives (their costs come
from the group's measured collective costs), nodes whose sizes have no
hint (data-dependent sizes), nodes that fail on stand-ins. The sum of separately run nodes is an upper
bound on what a compiler's fused kernels take; the scheduler compares it
with collective times, where the order of magnitude is what counts.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from sharc._compile import cost_store

_REPEATS = 3
_SKIPPED_NAMESPACES = ("sharc", "_c10d_functional", "c10d", "c10d_functional")
_BUDGET_S = 10.0  # the most a graph's profiling may take; the rest stays unmeasured


class CostCache:
    """Microseconds per call signature (see _signature); -1 for a call
    that cannot run on stand-ins. Bounded: the least recently used
    signatures go first. `persist`: also read from and written to this
    rank's cost file (cost_store.py); a test's cache keeps to memory."""

    def __init__(self, capacity: int = 8192, persist: bool = False):
        self.capacity = capacity
        self.persist = persist
        self._costs: OrderedDict[str, float] = OrderedDict()
        self._stored: dict[str, float] = {}  # the file's entries, read once per file
        self._stored_from: str | None = None  # which file they were read from
        self._unsaved: dict[str, float] = {}
        self.hits = self.measured = self.loaded = 0

    def get(self, key: str | None) -> float | None:
        if key is None:
            return None
        if key not in self._costs:
            us = self._from_file(key)
            if us is None:
                return None
            self._remember(key, us)
            self.loaded += 1
        self._costs.move_to_end(key)
        self.hits += 1
        return self._costs[key]

    def put(self, key: str | None, us: float) -> None:
        self.measured += 1
        if key is None:
            return
        self._remember(key, us)
        if self.persist:
            self._unsaved[key] = us

    def save(self) -> None:
        """Adds what was measured since the last save to the cost file."""
        if not self._unsaved:
            return
        entries = {**(cost_store.load(*_compute_file()) or {}), **self._unsaved}
        newest = dict(list(entries.items())[-self.capacity:])
        cost_store.store(*_compute_file(), newest)
        self._unsaved.clear()

    def _remember(self, key: str, us: float) -> None:
        self._costs[key] = us
        if len(self._costs) > self.capacity:
            self._costs.popitem(last=False)

    def _from_file(self, key: str) -> float | None:
        if not self.persist:
            return None
        where = cost_store.directory()
        if where != self._stored_from:  # the first look, or Inductor's cache moved
            self._stored, self._stored_from = cost_store.load(*_compute_file()) or {}, where
        us = self._stored.get(key)
        return us if isinstance(us, float | int) and not isinstance(us, bool) else None


def _compute_file() -> tuple[str, dict]:
    """This rank's compute-cost file: name and facts."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"compute-rank{rank}", {"rank": rank}


COSTS = CostCache(persist=True)


def profile_compute(graph: fx.Graph, cache: CostCache = COSTS) -> dict[fx.Node, float]:
    """Microseconds per call_function node of `graph`, as measured here
    (or earlier, for a call of the same signature: in this process, or in
    an earlier one whose costs `cache` keeps on disk)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and _measurable(n)]
    devices = _devices(nodes)
    costs = {}
    with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
        generator = torch.Generator().manual_seed(0)
        deadline = time.monotonic() + _BUDGET_S
        for n in nodes:
            key = _signature(n)
            us = cache.get(key)
            if us is None and time.monotonic() < deadline:
                us = _time_node(n, generator, devices)
                cache.put(key, us)
            if us is not None and us >= 0:
                costs[n] = us
    cache.save()
    return costs


def _signature(node: fx.Node) -> str | None:
    """What a call's cost depends on: the operator, each tensor input's
    sizes, strides, dtype and device (symbolic sizes at their hints), and
    its other arguments, written out (a key a later process can find);
    None when an argument cannot be part of a key."""
    def describe(arg):
        if not isinstance(arg, fx.Node):
            return arg
        return tree_map(_describe_value, arg.meta.get("val"))
    try:
        leaves, spec = tree_flatten(tree_map(describe, (node.args, node.kwargs)))
        key = (str(node.target), tuple(leaves), str(spec))
        hash(key)
        return repr(key)
    except (TypeError, _Symbolic):
        return None


def _describe_value(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(_hint(s) for s in value.shape),
                tuple(_hint(s) for s in value.stride()), value.dtype, str(value.device),
                value.layout)
    return _hint(value)


def _measurable(node: fx.Node) -> bool:
    """Operators only (a getitem or a Python function is bookkeeping), not
    sharc's nor a collective."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace not in _SKIPPED_NAMESPACES


def _devices(nodes: list[fx.Node]) -> set[torch.device]:
    devices = set()
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            devices.add(val.device)
    return devices or {torch.device("cpu")}


def _stand_in(value, generator: torch.Generator):
    """A real tensor like the recorded `value` (a fake tensor), or the
    value; symbolic sizes and scalars take their hints."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return _hint(value)
        return value
    shape = tuple(_hint(s) for s in value.shape)
    stride = tuple(_hint(s) for s in value.stride())
    out = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    if out.is_floating_point() or out.is_complex():
        filled = torch.randn(out.shape, generator=generator, dtype=out.dtype)
        out.copy_(filled)
    else:
        out.zero_()
    return out


class _Symbolic(Exception):
    """A size with no hint (data-dependent): the node is not measured."""


def _hint(value):
    """The value a symbolic int, float or bool had when traced."""
    if not isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value
    if not value.node.has_hint():
        raise _Symbolic()
    return value.node.hint


def _inputs(node: fx.Node, generator: torch.Generator):
    def real(arg):
        if not isinstance(arg, fx.Node):
            return arg
        return tree_map(lambda v: _stand_in(v, generator), arg.meta.get("val"))
    return tree_map(real, node.args), tree_map(real, node.kwargs)


def _time_node(node: fx.Node, generator: torch.Generator, devices) -> float:
    try:
        args, kwargs = _inputs(node, generator)
        times = []
        for i in range(_REPEATS + 1):
            _sync(devices)
            start = time.perf_counter()
            node.target(*args, **kwargs)
            _sync(devices)
            if i > 0:  # the first run is a warm-up
                times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    except Exception:  # noqa: BLE001  (a node that cannot run on stand-ins stays unmeasured)
        return -1.0


def _sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
