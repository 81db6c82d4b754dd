"""FX graph -> sharc scheduling IR (the text form of include/sharc/ir.h).

What the IR keeps of a graph: every node in order with the values it reads
and the bytes it produces; each all_gather becomes a direct read of its
parameter (`@i`), so the passes decide where gathers, waits and releases go;
each reduce_scatter becomes a gradient marker (`grad=@i`), so the passes
decide how gradients are bucketed. Nodes that read a view of a gathered
parameter also read the parameter, so its release waits for them.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from sharc._compile.errors import SharcCompileError
from sharc._compile.merge_gradients import is_local_add
from sharc._compile.ops import (ALL_GATHER, REDUCE_SCATTER, cast_dtype, dtype_name, is_call,
                                is_exit_cast, is_view, param_key)
from sharc._compile.sizes import SizeSymbols, static_bytes


@dataclass
class ParamSlot:
    """One sharded parameter as one graph sees it."""

    ir_id: int
    group: str
    pid: int
    bytes: int
    dtype: torch.dtype | None = None  # of the gathered value
    shard: fx.Node | None = None  # the shard the graph gathers from
    gathers: list[fx.Node] = field(default_factory=list)
    casts: list[fx.Node] = field(default_factory=list)  # of a gather's output, directly
    reductions: list[fx.Node] = field(default_factory=list)
    exit_casts: list[fx.Node] = field(default_factory=list)  # of the reductions' results
    # reduction + local terms ([Note: local gradient terms]), outside the IR
    local_adds: list[fx.Node] = field(default_factory=list)


@dataclass
class LoweredGraph:
    text: str
    slots: dict[int, ParamSlot]
    values: dict[str, fx.Node]  # IR value name -> the FX node it stands for
    grad_markers: dict[str, fx.Node]  # IR marker name -> its reduce_scatter node
    folded: dict[fx.Node, list[fx.Node]]  # multi-output node -> its getitems


class _Lowering:
    def __init__(self, graph: fx.Graph, costs: dict[fx.Node, float], kept: dict[int, int]):
        self.graph = graph
        self.costs = costs  # measured microseconds per node (profile.py)
        self.kept = kept  # runtime id -> bytes, of parameters that stay gathered
        self.slots: dict[tuple[str, int], ParamSlot] = {}
        self.aliases: dict[fx.Node, int] = {}  # views of gathered parameters
        self.cast_views: dict[fx.Node, fx.Node] = {}  # views of a gathered param's cast -> it
        self.lines: list[str] = []
        self.values: dict[str, fx.Node] = {}
        self.grad_markers: dict[str, fx.Node] = {}
        self.folded: dict[fx.Node, list[fx.Node]] = {}
        self.sizes = SizeSymbols()

    def run(self) -> LoweredGraph:
        self._collect_params()
        body = [line for node in self.graph.nodes for line in self._lower(node)]
        header = [f'param @{s.ir_id} "{s.group}/{s.pid}" bytes={s.bytes}' +
                  (f" dtype={dtype_name(s.dtype)}" if s.dtype is not None else "") +
                  (" kept" if s.pid in self.kept else "")
                  for s in self.slots.values()]
        # Kept parameters this graph does not read still hold their bytes.
        read = {s.pid for s in self.slots.values()}
        group = next(iter(self.slots.values())).group if self.slots else ""
        header += [f'param @{len(self.slots) + i} "{group}/{pid}" bytes={nbytes} kept'
                   for i, (pid, nbytes) in enumerate(sorted(
                       (p, b) for p, b in self.kept.items() if p not in read))]
        header += self.sizes.header()  # the symbols the body's sizes read
        slots = {s.ir_id: s for s in self.slots.values()}
        return LoweredGraph("\n".join(header + body) + "\n", slots, self.values,
                            self.grad_markers, self.folded)

    def _slot(self, node: fx.Node, bytes_: int) -> ParamSlot:
        key = param_key(node)
        if key not in self.slots:
            self.slots[key] = ParamSlot(len(self.slots), *key, bytes_)
        return self.slots[key]

    def _collect_params(self) -> None:
        for node in self.graph.nodes:
            if is_call(node, ALL_GATHER):
                slot = self._slot(node, static_bytes(node))
                slot.gathers.append(node)
                slot.shard = slot.shard or node.args[0]
                slot.dtype = node.meta["val"].dtype
            elif is_call(node, REDUCE_SCATTER):
                slot = self._slot(node, static_bytes(node.args[0]))
                slot.reductions.append(node)
                slot.exit_casts += [u for u in node.users if is_exit_cast(u)]
                slot.local_adds += [u for u in node.users if is_local_add(u)]
                if any(u.op != "output" and not is_exit_cast(u) and not is_local_add(u)
                       for u in node.users):
                    raise SharcCompileError(
                        f"sharc: reduced gradient '{node.name}' is read inside the graph; "
                        "this is a sharc bug, please report it with the model")
            elif is_view(node) and node.args[0] in self.aliases:
                self.aliases[node] = self.aliases[node.args[0]]
            elif cast_dtype(node) is not None and is_call(node.args[0], ALL_GATHER):
                self.slots[param_key(node.args[0])].casts.append(node)
            elif is_view(node) and (node.args[0] in self.cast_views or
                                    node.args[0] in self._gather_casts()):
                self.cast_views[node] = self.cast_views.get(node.args[0], node.args[0])
            if is_call(node, ALL_GATHER):
                self.aliases[node] = self.slots[param_key(node)].ir_id
        if len({s.group for s in self.slots.values()}) > 1:
            raise SharcCompileError(
                "sharc: one compiled graph reads parameters sharded over more than one "
                "process group; compile each sharded model separately")

    def _gather_casts(self) -> set[fx.Node]:
        return {c for s in self.slots.values() for c in s.casts}

    def _operands(self, node: fx.Node) -> list[str]:
        ops = []
        for inp in node.all_input_nodes:
            if is_call(inp, ALL_GATHER):
                ops.append(f"@{self.aliases[inp]}")
                continue
            ops.append(f"%{inp.name}")
            if inp in self.aliases:
                ops.append(f"@{self.aliases[inp]}")
            if inp in self.cast_views:
                # Reading a view of a parameter's cast reads the cast too: if
                # cast_before_gather folds the cast into the gather, the
                # release then waits for this node.
                ops.append(f"%{self.cast_views[inp].name}")
        return list(dict.fromkeys(ops))

    def _lower(self, node: fx.Node) -> list[str]:
        if node.op == "placeholder":
            self.values[node.name] = node
            return [f"%{node.name} = input {self.sizes.size_of(node).ir()}"]
        if node.op == "output":
            return [self._lower_output(node)]
        if (is_call(node, ALL_GATHER) or self._is_folded_getitem(node) or
                self._is_exit_cast(node) or is_local_add(node)):
            return []
        if is_call(node, REDUCE_SCATTER):
            return [self._lower_reduction(node)]
        return [self._lower_compute(node)]

    def _lower_reduction(self, node: fx.Node) -> str:
        slot = self.slots[param_key(node)]
        marker = f"sharc_grad_{node.name}"
        self.grad_markers[marker] = node
        grad = node.args[0]
        operand = f"@{self.aliases[grad]}" if is_call(grad, ALL_GATHER) else f"%{grad.name}"
        return (f'%{marker} = compute "grad" {operand} '
                f"bytes={static_bytes(grad)} grad=@{slot.ir_id}")

    def _lower_compute(self, node: fx.Node) -> str:
        outputs = [node]
        if isinstance(node.meta.get("val"), (tuple, list)):
            items = sorted((u for u in node.users if u.target is operator.getitem),
                           key=lambda u: u.args[1])
            if items:
                self.folded[node] = items
                outputs = items
        for out in outputs:
            self.values[out.name] = node if out is node else out
        names = ", ".join(f"%{o.name}" for o in outputs)
        target = node.target
        name = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(
            target, "__name__", str(target))
        op = re.sub(r"[^A-Za-z0-9_.]", "", name)  # one token in the IR text
        args = " ".join(self._operands(node))
        dtype = cast_dtype(node)
        cast = f" cast={dtype_name(dtype)}" if dtype is not None else ""
        cost = f" cost={self.costs[node]:.3g}" if node in self.costs else ""
        size = self.sizes.size_of(node).ir()
        return f'{names} = compute "{op}" {args} {size}{cast}{cost}'.replace(
            "  ", " ")

    def _is_exit_cast(self, node: fx.Node) -> bool:
        return is_exit_cast(node) and is_call(node.args[0], REDUCE_SCATTER)

    def _is_folded_getitem(self, node: fx.Node) -> bool:
        return node.target is operator.getitem and node.args[0] in self.folded

    def _lower_output(self, node: fx.Node) -> str:
        operands = []
        for value in node.all_input_nodes:
            if is_call(value, REDUCE_SCATTER) or self._is_exit_cast(value):
                continue  # shard gradients leave through their bucket
            if is_local_add(value):
                # The reduced part leaves through its bucket; the local terms'
                # sum must live until ir_to_fx adds it after the wait.
                value = value.args[1]
            if is_call(value, ALL_GATHER) or value in self.aliases:
                raise SharcCompileError(
                    f"sharc: graph output '{value.name}' is a gathered parameter; the "
                    "partitioner was told to recompute gathers, so this is a sharc bug")
            operands.append(f"%{value.name}")
        return " ".join(["output", *dict.fromkeys(operands)])


def lower(graph: fx.Graph, costs: dict[fx.Node, float] | None = None,
          kept: dict[int, int] | None = None) -> LoweredGraph:
    """The IR of `graph`; compute nodes carry `cost=` (µs) where `costs` has
    one; `kept` (runtime id -> full bytes) are the parameters that stay
    gathered: those the graph reads are marked `kept`, the others declared
    `kept` too (unread), so that the budget counts their bytes."""
    return _Lowering(graph, costs or {}, dict(kept or {})).run()
