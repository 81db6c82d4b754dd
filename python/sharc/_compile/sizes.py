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

A size can also be a constant that torch leaves unsimplified: when two
input dimensions are equal, `dynamic=True` gives them one symbol `s`, a
`b*t` becomes `s**2`, and a weight gradient's size comes out as
`64*((4*((s**2)//s))//s)`, which is 256 at every `s`. Such a size is
written as the constant (see `_constant`): a parameter's gradient must be,
and an activation's might as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

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
        constant = _constant(total)
        if constant is not None:
            return Size(constant)
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
    gradient); raises naming the node otherwise. A symbolic size that is a
    constant in disguise (`_constant`) is that constant."""
    total = _total_bytes(node.meta.get("val"))
    if isinstance(total, torch.SymInt):
        constant = _constant(total)
        if constant is not None:
            return constant
        from sharc._compile.errors import SharcCompileError
        raise SharcCompileError(
            f"sharc: '{node.name}' has a symbolic size ({total}), but a sharded parameter "
            "and its gradient have static sizes; this is a sharc bug, please report it")
    return int(total)


def _constant(total: torch.SymInt) -> int | None:
    """The value of a symbolic size that is the same at every binding of
    its symbols, or None where it may vary (or that cannot be shown).

    Two ways, neither of which adds a guard: the expression with torch's
    integer divisions written as sympy's floor and ceiling of a quotient,
    which sympy cancels (`(s**2)//s` is `floor(s**2/s)`, `floor(s)`, and
    `s`, an integer symbol), where torch's own division class keeps it;
    then the graph's ShapeEnv, asked whether the size is statically known
    to equal its hint (its replacements and value ranges included). A
    value found the first way must equal the hint too."""
    expr = total.node.expr
    if expr.is_number:
        return int(expr)
    hint = optimization_hint(total, fallback=0) if total.node.has_hint() else None
    try:
        reduced = _as_sympy_integer_math(expr)
    except (_Unsupported, TypeError, ValueError, ZeroDivisionError) as e:
        log.debug("sharc: size %s not reduced (%s)", expr, e)
        reduced = None
    if reduced is not None and reduced.is_Integer and (hint is None or int(reduced) == hint):
        return int(reduced)
    if hint is not None:
        try:
            if statically_known_true(total == hint):
                return int(hint)
        except Exception as e:  # noqa: BLE001 (a question about the size, never fatal)
            log.debug("sharc: size %s not asked of the shape env (%s)", expr, e)
    return None


def _as_sympy_integer_math(e: sympy.Expr) -> sympy.Expr:
    """`e` with torch's integer-division functions replaced by sympy's own
    arithmetic on the same integers (Python's floor semantics), so that
    sympy's automatic simplification applies; raises _Unsupported for a
    function it has no such form of."""
    if not e.args:
        return e
    args = [_as_sympy_integer_math(a) for a in e.args]
    name = type(e).__name__
    if name in ("FloorDiv", "CleanDiv"):
        return sympy.floor(args[0] / args[1])
    if name == "CeilDiv":
        return sympy.ceiling(args[0] / args[1])
    if name in ("Mod", "PythonMod"):
        return sympy.Mod(args[0], args[1])
    if name == "ModularIndexing":
        return sympy.Mod(sympy.floor(args[0] / args[1]), args[2])
    if name == "PowByNatural":
        return sympy.Pow(args[0], args[1])
    if e.is_Add or e.is_Mul or e.is_Pow or name in ("Max", "Min"):
        return e.func(*args)
    raise _Unsupported(name)


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
