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
devices, and its other arguments) is measured once per process: the
identical blocks of a model, the blocks of a model compiled one by one,
and a recompile all reuse what was measured (`CostCache`). A cost of an
operator on this process's device is a fact of the process, so the cache
belongs to it, like Dynamo's and Inductor's own caches.

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
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

_REPEATS = 3
_SKIPPED_NAMESPACES = ("sharc", "_c10d_functional", "c10d", "c10d_functional")
_BUDGET_S = 10.0  # the most a graph's profiling may take; the rest stays unmeasured


class CostCache:
    """Microseconds per call signature (see _signature), measured in this
    process; -1 for a call that cannot run on stand-ins. Bounded: the
    least recently used signatures go first."""

    def __init__(self, capacity: int = 8192):
        self.capacity = capacity
        self._costs: OrderedDict[tuple, float] = OrderedDict()
        self.hits = self.measured = 0

    def get(self, key) -> float | None:
        if key is None or key not in self._costs:
            return None
        self._costs.move_to_end(key)
        self.hits += 1
        return self._costs[key]

    def put(self, key, us: float) -> None:
        self.measured += 1
        if key is None:
            return
        self._costs[key] = us
        if len(self._costs) > self.capacity:
            self._costs.popitem(last=False)


COSTS = CostCache()


def profile_compute(graph: fx.Graph, cache: CostCache = COSTS) -> dict[fx.Node, float]:
    """Microseconds per call_function node of `graph`, as measured here
    (or earlier in this process, for a call of the same signature)."""
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
    return costs


def _signature(node: fx.Node):
    """What a call's cost depends on: the operator, each tensor input's
    sizes, strides, dtype and device (symbolic sizes at their hints), and
    its other arguments; None when an argument cannot be part of a key."""
    def describe(arg):
        if not isinstance(arg, fx.Node):
            return arg
        return tree_map(_describe_value, arg.meta.get("val"))
    try:
        leaves, spec = tree_flatten(tree_map(describe, (node.args, node.kwargs)))
        key = (str(node.target), tuple(leaves), str(spec))
        hash(key)
        return key
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
