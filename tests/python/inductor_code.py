"""Reads the Python wrapper code Inductor generated, in the order it really
runs, to check where sharc's releases landed."""

from __future__ import annotations

import re

_RELEASE = re.compile(r"torch\.ops\.sharc\.release\.default\((\w+)")
_ASSIGN = re.compile(r"^\s*(\w+) = (.*)$")
_ALIAS_RHS = re.compile(r"^(\w+(\[\d+\])?|reinterpret_tensor\(.*|as_strided\(.*)$")


def _call_body(source: str) -> list[str]:
    start = source.index("def call(")
    end = source.find("\nrunner = ", start)
    return source[start:end if end > 0 else None].splitlines()


def _aliases(lines: list[str], name: str, upto: int) -> set[str]:
    """`name` and every name bound to a view or alias of it before line `upto`
    (`bufX = bufN`, `bufX = bufN[0]`, `bufX = reinterpret_tensor(bufN, ...)`)."""
    names = {name}
    for line in lines[:upto]:
        m = _ASSIGN.match(line.split(";")[0])
        if m and _ALIAS_RHS.match(m.group(2).strip()) and any(
                re.search(rf"\b{n}\b", m.group(2)) for n in names):
            names.add(m.group(1))
    return names


def reads_after_release(source: str) -> list[str]:
    """Lines of the generated `call` that touch a gathered buffer (or an alias
    of it, or reuse its storage) after sharc released it. Empty when every
    release runs after the last kernel that reads its buffer."""
    lines = _call_body(source)
    bad = []
    for i, line in enumerate(lines):
        m = _RELEASE.search(line)
        if not m:
            continue
        names = _aliases(lines, m.group(1), i)
        for later in lines[i + 1:]:
            code = later.split("#")[0]
            if re.match(r"^\s*del ", code):
                continue
            if any(re.search(rf"\b{n}\b", code) for n in names):
                bad.append(f"after release of {m.group(1)}: {later.strip()}")
    return bad


def release_count(source: str) -> int:
    return len(_RELEASE.findall(source))
