"""Scheduled IR -> FX graph: the bridge's way back.

Walks the scheduled nodes in order and builds a new graph: compute nodes are
copied from the original, and each communication node becomes the op of its
name: gather / wait / release become sharc.start_gather / wait_gather /
release, reduce_scatter / wait_reduce become sharc.start_reduce_scatter /
wait_reduce_scatter, where the passes placed them, all_reduce (hybrid
sharding) becomes sharc.start_replicate_all_reduce, and prefetch_next
becomes sharc.prefetch_next_graph. The waited shard gradients replace the
original per-parameter reductions at the graph output.
A parameter that cast_before_gather narrowed is gathered in the narrow dtype
and its folded casts' users read the gathered value.
"""

from __future__ import annotations

import operator

import torch.fx as fx

import torch

from sharc._compile.fx_to_ir import LoweredGraph, ParamSlot
from sharc._compile.ops import (PREFETCH_NEXT_GRAPH, RELEASE, START_GATHER,
                                START_REDUCE_SCATTER, START_REPLICATE_ALL_REDUCE, WAIT_GATHER,
                                WAIT_REDUCE_SCATTER, is_call, is_tensor, is_view)


class _Rebuild:
    def __init__(self, original: fx.Graph, lowered: LoweredGraph, dtypes: dict[int, str],
                 graph_kind: int, budget: int):
        self.original = original
        self.lowered = lowered
        self.dtypes = dtypes  # IR param -> the dtype the schedule gathers it in
        self.graph_kind = graph_kind  # ops.FORWARD_GRAPH or ops.BACKWARD_GRAPH
        self.budget = budget  # the schedule's memory budget (-1: none)
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}   # original node -> new node
        self.by_value: dict[str, fx.Node] = {}  # IR value -> new node
        self.full: dict[int, fx.Node] = {}      # IR param -> its gathered value now
        self.in_flight: dict[str, list[int]] = {}  # gather value -> its IR params
        self.reducing: dict[str, list[int]] = {}  # reduction token -> its IR params

    def run(self, nodes: list[tuple[str, list[str], list[str], list[int]]]) -> fx.Graph:
        for node in self.original.nodes:
            if node.op == "placeholder":
                self._bind(node, self.graph.node_copy(node))
        for kind, outputs, operands, params in nodes:
            getattr(self, f"_{kind}")(outputs, operands, params)
        self._add_local_terms()
        output = self.original.output_node()
        self.graph.node_copy(output, lambda n: self.env[n])
        return self.graph

    def _add_local_terms(self) -> None:
        """Each reduced gradient plus its parameter's local terms, after every
        wait ([Note: local gradient terms] in merge_gradients.py)."""
        for slot in self.lowered.slots.values():
            for add in slot.local_adds:
                self.env[add] = self.graph.node_copy(add, lambda n: self.env[n])

    def _bind(self, original: fx.Node, new: fx.Node) -> None:
        self.env[original] = new
        self.by_value[original.name] = new

    def _value(self, name: str) -> fx.Node:
        return self.by_value[name]

    def _call(self, target, args, val=None) -> fx.Node:
        node = self.graph.call_function(target, args)
        if val is not None:
            node.meta["val"] = val
        return node

    def _slots(self, params: list[int]):
        slots = [self.lowered.slots[p] for p in params]
        return slots, slots[0].group, [s.pid for s in slots]

    def _gathered_dtype(self, slot: ParamSlot) -> torch.dtype:
        name = self.dtypes.get(slot.ir_id) or ""
        return getattr(torch, name) if name else slot.dtype

    def _folded_casts(self, slot: ParamSlot) -> list[fx.Node]:
        """The casts cast_before_gather folded into the gather: all of the
        slot's, when it narrowed the gather's dtype."""
        return slot.casts if self._gathered_dtype(slot) != slot.dtype else []

    def _full_meta(self, slot: ParamSlot):
        folded = self._folded_casts(slot)
        return (folded[0] if folded else slot.gathers[0]).meta.get("val")

    # -- one handler per IR node kind --------------------------------------
    def _input(self, outputs, operands, params) -> None:
        pass  # placeholders were copied first, in their original order

    def _output(self, outputs, operands, params) -> None:
        pass  # copied last, from the original (_wait_reduce mapped its reductions)

    def _compute(self, outputs, operands, params) -> None:
        name = outputs[0]
        if name in self.lowered.grad_markers:  # the gradient is its operand
            self.by_value[name] = self._value(operands[0])
            return
        original = self.lowered.values[name]
        if original.target is operator.getitem and original.args[0] in self.lowered.folded:
            original = original.args[0]
        self._bind(original, self.graph.node_copy(original, lambda n: self.env[n]))
        for item in self.lowered.folded.get(original, []):
            self._bind(item, self.graph.node_copy(item, lambda n: self.env[n]))

    def _gather(self, outputs, operands, params) -> None:
        slots, group, pids = self._slots(params)
        shards = [self.env[s.shard] for s in slots]
        dtype = self._gathered_dtype(slots[0])  # a bucket has one dtype
        self.by_value[outputs[0]] = self._call(START_GATHER,
                                               (shards, group, pids, dtype, self.graph_kind))
        self.in_flight[outputs[0]] = params

    def _wait(self, outputs, operands, params) -> None:  # a wait names its gather only
        slots, group, pids = self._slots(self.in_flight.pop(operands[0]))
        dtype = self._gathered_dtype(slots[0])
        waited = self._call(WAIT_GATHER, (self._value(operands[0]), group, pids, dtype),
                            [self._full_meta(s) for s in slots])
        for i, (slot, name) in enumerate(zip(slots, outputs)):
            full = self._call(operator.getitem, (waited, i), self._full_meta(slot))
            self.full[slot.ir_id] = self.by_value[name] = full
            for read in slot.gathers + self._folded_casts(slot):
                self.env[read] = full

    def _release(self, outputs, operands, params) -> None:
        after = [n for n in map(self._value, operands) if is_tensor(n)]
        for slot in (self.lowered.slots[p] for p in params):
            self._call(RELEASE, (self.full[slot.ir_id], after, slot.group, slot.pid))

    def _prefetch_next(self, outputs, operands, params) -> None:  # params name this graph
        after = [n for n in map(self._value, operands) if is_tensor(n)]
        slots, group, pids = self._slots(params)
        shards = [self.env[s.shard] for s in slots]
        self._call(PREFETCH_NEXT_GRAPH,
                   (shards, after, group, self.graph_kind, pids, self.budget))

    def _reduce_scatter(self, outputs, operands, params) -> None:
        slots, group, pids = self._slots(params)
        grads = [self._value(o) for o in operands]
        self.by_value[outputs[0]] = self._call(START_REDUCE_SCATTER, (grads, group, pids))
        self.reducing[outputs[0]] = params

    def _all_reduce(self, outputs, operands, params) -> None:  # it names its reduction only
        reduced = self.reducing.pop(operands[0])
        _, group, pids = self._slots(reduced)
        self.by_value[outputs[0]] = self._call(START_REPLICATE_ALL_REDUCE,
                                               (self._value(operands[0]), group, pids))
        self.reducing[outputs[0]] = reduced

    def _wait_reduce(self, outputs, operands, params) -> None:  # it names its reduction only
        slots, group, pids = self._slots(self.reducing.pop(operands[0]))
        vals = [s.reductions[0].meta.get("val") for s in slots]
        waited = self._call(WAIT_REDUCE_SCATTER, (self._value(operands[0]), group, pids), vals)
        for i, (slot, name) in enumerate(zip(slots, outputs)):
            shard_grad = self._call(operator.getitem, (waited, i), vals[i])
            self.by_value[name] = shard_grad
            for reduction in slot.reductions:
                self.env[reduction] = shard_grad
            for cast in slot.exit_casts:  # dropped: see ops.is_exit_cast
                self.env[cast] = shard_grad


def rebuild(original: fx.Graph, lowered: LoweredGraph,
            nodes: list[tuple[str, list[str], list[str], list[int]]],
            dtypes: dict[int, str], graph_kind: int, budget: int) -> fx.Graph:
    """The new graph for `original` scheduled as `nodes`: Schedule.nodes'
    (kind, outputs, value operands, parameter ids), in order, with each
    parameter gathered in `dtypes`' dtype (its IR name; "" for as it is).
    `graph_kind` (ops.FORWARD_GRAPH or BACKWARD_GRAPH) and `budget` (the
    schedule's memory budget, -1 for none) go to the runtime for
    cross-graph prefetch."""
    graph = _Rebuild(original, lowered, dtypes, graph_kind, budget).run(nodes)
    _release_after_live_values(graph)
    return graph


# [Note: a release waits for the values computed from its buffer]
# The C++ pass makes a release read its parameter's last users' outputs
# (insert_gather_release.cpp, `sinks`), so Inductor computes each of them
# before the release. That does not stop a read of the freed buffer later:
# Inductor lowers nodes in graph order and inlines an unrealized pointwise
# value into each consumer as it lowers it, so a consumer lowered before the
# release (`t = b * 1` then `u = x + t`, with the release after `b`'s last
# use) carries the read of `b` in its own loop body, and when `u` is used
# after the release, the kernel that finally computes it runs there and
# reads freed storage. Seen with a Linear run under no_grad and again with
# grad, on one row (Inductor's CPU addmm decomposition makes `bias * 1`):
# the released bias was read. A release therefore also reads every value
# computed from its buffer before it and used after it: as inputs of the
# release's fallback kernel they are realized there, before any later node
# lowers, so later kernels load them instead of recomputing them from the
# buffer, and each is computed before the release frees the buffer.


def _release_after_live_values(graph: fx.Graph) -> None:
    position = {node: i for i, node in enumerate(graph.nodes)}
    for release in [n for n in graph.nodes if is_call(n, RELEASE)]:
        full, after = release.args[0], release.args[1]
        live = _computed_from(full, position, position[release])
        release.args = (full, after + [n for n in live if n not in after], *release.args[2:])


def _computed_from(full: fx.Node, position: dict[fx.Node, int], release: int) -> list[fx.Node]:
    """The tensors computed from `full` (not views of it) before position
    `release` and used after it, in graph order."""
    derived, stack = {full}, [full]
    while stack:
        for user in stack.pop().users:
            if user not in derived and position[user] < release:
                derived.add(user)
                stack.append(user)
    live = [n for n in derived
            if n is not full and is_tensor(n) and not _views(n, full)
            and any(position[u] > release for u in n.users)]
    return sorted(live, key=position.__getitem__)


def _views(node: fx.Node, full: fx.Node) -> bool:
    while is_view(node):
        node = node.args[0]
    return node is full
