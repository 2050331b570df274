"""Where vLLM's ``kernel_warmup`` ends its process-local section, read from its source.

From vLLM 0.28 on, ``kernel_warmup(worker, *, process_local_only=False)`` runs the
per-process JIT warm-ups first and then ``if process_local_only: return``; what follows
may run collectives (autotuning that agrees across ranks, dummy runs). Elastic EP calls
it with ``process_local_only=True`` on new workers alone, so vLLM itself relies on the
part before that line running no collective: exactly what a host-wide lock around it
needs. vLLM 0.26 has no such flag.

The warm-up lock holds its slot over that whole section only where the source has
this shape: the flag is a keyword-only parameter, it is read once, as the test of a
top-level ``if`` whose body is a bare ``return``. Anything else (0.26, a rewritten
function, no source) leaves the lock on its fallback list of warm-up names. Imports
nothing heavy: ``check`` and the compat matrix use it on source text.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

FLAG = "process_local_only"
# Names whose call inside the section would be a collective: never expected there.
COLLECTIVE_HINTS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "barrier",
)


@dataclass(frozen=True)
class Section:
    """The process-local section of one ``kernel_warmup``: every name it calls (functions
    and methods), or why it has none the lock can use (``calls`` is then empty)."""

    calls: tuple[str, ...]
    why_not: str | None = None

    @property
    def usable(self) -> bool:
        return self.why_not is None

    @property
    def warm_ups(self) -> tuple[str, ...]:
        """The calls that compile or tune something, for a log line or a table."""
        return tuple(n for n in self.calls if "warmup" in n or "autotune" in n)

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(n for n in self.calls if any(h in n.lower() for h in COLLECTIVE_HINTS))


def _called_names(statements: list[ast.stmt]) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name:
                    names.setdefault(name)
    return tuple(names)


def _is_bare_flag_return(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == FLAG
        and len(node.body) == 1
        and isinstance(node.body[0], ast.Return)
        and node.body[0].value is None
        and not node.orelse
    )


def process_local_section(source: str, function: str = "kernel_warmup") -> Section:
    """The section of ``function`` in ``source`` (a module's or the function's own)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        return Section((), f"its source does not parse ({exc})")
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == function
    ]
    if not found:
        return Section((), f"no {function} in the source")
    node = found[0]
    if FLAG not in [a.arg for a in node.args.kwonlyargs]:
        return Section((), f"{function} has no keyword-only {FLAG} parameter")
    reads = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == FLAG]
    ends = [i for i, statement in enumerate(node.body) if _is_bare_flag_return(statement)]
    if len(reads) != 1 or len(ends) != 1:
        return Section(
            (), f"{function} reads {FLAG} {len(reads)} times, not once as 'if {FLAG}: return'"
        )
    return Section(_called_names(node.body[: ends[0]]))
