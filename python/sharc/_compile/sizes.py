"""Byte sizes of FX values as the IR writes them: a number, or under
dynamic shapes a hint plus an expression over the graph's size symbols.

Dynamo compiles a graph with symbolic sizes when asked
(`torch.compile(dynamic=True)`, `torch._dynamo.mark_dynamic`) and on its
own once an input's size changed (automatic dynamic shapes). A value's size
is then a sympy expression over symbols like `s0`; the IR gets the size at
the symbols' hints (the values they had when the graph was traced, which
is what profiling measures at) and the expression in the IR's own grammar
(include/sharc/compiler/size_expr.h), which is Python's integer grammar
restricted to + - * // % ** Max Min. An expression outside it (true
division, a rounding function) is written as its hint alone: activation
sizes only inform costs, and parameters, the only sizes a schedule decides
anything from, are always static.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13 (2.11 on the GPU machines) names it size_hint
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint

log = logging.getLogger("sharc")


@dataclass(frozen=True)
class Size:
    hint: int
    expr: str | None = None  # the IR's grammar; None when the size is static

    def ir(self) -> str:
        return f"bytes={self.hint}" + (f' sym="{self.expr}"' if self.expr else "")


class SizeSymbols:
    """The size symbols one graph's values read, with their hints (None:
    data-dependent, no hint), collected as sizes are asked for."""

    def __init__(self) -> None:
        self.hints: dict[str, int | None] = {}

    def size_of(self, node: fx.Node) -> Size:
        total = _total_bytes(node.meta.get("val"))
        if not isinstance(total, torch.SymInt):
            return Size(int(total))
        expr = total.node.expr
        hint = optimization_hint(total, fallback=0)
        if expr.is_number:
            return Size(int(expr))
        hints = self._symbol_hints(expr, total.node.shape_env)
        text = _checked_text(expr, hints, hint)
        if text is None:
            return Size(hint)
        self.hints.update(hints)
        return Size(hint, text)

    def header(self) -> list[str]:
        return [f"size {name}" + ("" if hint is None else f" hint={hint}")
                for name, hint in sorted(self.hints.items())]

    @staticmethod
    def _symbol_hints(expr: sympy.Expr, shape_env) -> dict[str, int | None]:
        hints = {}
        for symbol in expr.free_symbols:
            value = _backed_values(shape_env).get(symbol)
            hints[symbol.name] = None if value is None else int(value)
        return hints


def static_bytes(node: fx.Node) -> int:
    """Bytes of a value that must have a static size (a parameter, its
    gradient); raises naming the node otherwise."""
    total = _total_bytes(node.meta.get("val"))
    if isinstance(total, torch.SymInt):
        from sharc._compile.errors import SharcCompileError
        raise SharcCompileError(
            f"sharc: '{node.name}' has a symbolic size ({total}), but a sharded parameter "
            "and its gradient have static sizes; this is a sharc bug, please report it")
    return int(total)


def _total_bytes(val):
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return 0


class _Unsupported(Exception):
    """An expression outside the IR's size grammar."""


def _checked_text(expr: sympy.Expr, hints: dict[str, int | None], hint: int) -> str | None:
    """`expr` in the IR's grammar, or None where it has no such form. The
    grammar is Python's, so the text is checked here against the hint: a
    translation that disagrees with torch's own value is never emitted."""
    try:
        text = _text(expr)
    except _Unsupported as e:
        log.debug("sharc: size %s kept as its hint %d (%s)", expr, hint, e)
        return None
    if all(v is not None for v in hints.values()):
        value = eval(text, {"__builtins__": {}, "Max": max, "Min": min}, dict(hints))  # noqa: S307
        if value != hint:
            log.debug("sharc: size %s written %s gives %s, not %d; kept as its hint",
                      expr, text, value, hint)
            return None
    return text


def _text(e: sympy.Expr) -> str:
    """The IR grammar's text of a sympy integer expression (fully
    parenthesised where operators nest)."""
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return e.name
    if e.is_Add:
        return "(" + " + ".join(_text(a) for a in e.args) + ")"
    if e.is_Mul:
        return "(" + "*".join(_text(a) for a in e.args) + ")"
    if e.is_Pow:
        base, exponent = e.args
        if not (exponent.is_Integer and int(exponent) >= 0):
            raise _Unsupported(f"power {exponent}")
        return f"({_text(base)})**{int(exponent)}"
    return _function_text(e)


def _function_text(e: sympy.Expr) -> str:
    name = type(e).__name__
    args = [_text(a) for a in e.args]
    if name in ("FloorDiv", "CleanDiv"):
        return f"({args[0]}//{args[1]})"
    if name == "CeilDiv":
        return f"(-((-{args[0]})//{args[1]}))"
    if name in ("Mod", "PythonMod"):
        return f"({args[0]} % {args[1]})"
    if name == "ModularIndexing":
        return f"(({args[0]}//{args[1]}) % {args[2]})"
    if name == "PowByNatural":
        return f"({args[0]})**({args[1]})"
    if name in ("Max", "Min"):
        return f"{name}({', '.join(args)})"
    raise _Unsupported(name)


def _backed_values(shape_env) -> dict:
    """Symbol -> the value it was traced with (torch renamed the table)."""
    if shape_env is None:
        return {}
    table = getattr(shape_env, "backed_var_to_val", None)
    return table if table is not None else shape_env.var_to_val
