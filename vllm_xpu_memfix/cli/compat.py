"""Static check of patch targets against a vLLM source tree, importing nothing.

Reads the ``.py`` files with :mod:`ast`, so it works on the installed vLLM
without starting torch, and on any unpacked vLLM wheel or checkout.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PRESENT = "present"
# Modules only Intel's llm-scaler images ship; upstream vLLM lacks them by design.
INTEL_IMAGE_MODULES = frozenset({"vllm.model_executor.layers.quantization.sym_int4"})


def installed_vllm_root() -> Path | None:
    """The directory that holds the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class Unreadable(Exception):
    """A module file that is there but is not Python source: bad UTF-8, a NUL byte, a
    syntax error, or a read error."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _parse(path: Path) -> tuple[str, ast.Module]:
    try:
        source = path.read_text(encoding="utf-8")
        return source, ast.parse(source, str(path))
    except UnicodeDecodeError as exc:
        raise Unreadable(path, f"not UTF-8 (byte {exc.start})") from None
    except SyntaxError as exc:
        where = f" at line {exc.lineno}" if exc.lineno else ""
        raise Unreadable(path, f"syntax error{where}: {exc.msg}") from None
    except ValueError as exc:  # a NUL byte, on Python versions that raise ValueError for it
        raise Unreadable(path, str(exc)) from None
    except OSError as exc:
        raise Unreadable(path, exc.strerror or str(exc)) from None
    except (RecursionError, MemoryError):  # ast's limits on nesting
        raise Unreadable(path, "nested too deeply to parse") from None


def module_source(root: Path, module: str) -> str | None:
    """The source text of ``module`` in the tree under ``root``; None when it is absent.
    Raises :class:`Unreadable` when the file is there but is not Python source."""
    path = _module_file(root, module)
    return _parse(path)[0] if path is not None else None


def _names_bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds, including in module-level ``if``/``try`` branches
    (a module may define a function only in some configurations)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If):
            names = {**_names_bound(node.orelse), **_names_bound(node.body), **names}
        elif isinstance(node, ast.Try):
            branches = [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
            for branch in branches:
                names = {**_names_bound(branch), **names}
    return names


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    names = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    return names[1:] if method and names[:1] in (["self"], ["cls"]) else names


def target_status(root: Path, target: str, params: tuple[str, ...] = ()) -> str:
    """``present``, ``missing: <what>``, or ``signature changed: ...`` when the target's
    leading parameters are not the ``params`` its wrapper reads. Raises
    :class:`Unreadable` for a module file that is not Python source."""
    module, _, attr_path = target.partition(":")
    path = _module_file(root, module)
    if path is None:
        only_intel = " (Intel's images only)" if module in INTEL_IMAGE_MODULES else ""
        return f"missing: module {module}{only_intel}"
    body: list[ast.stmt] = _parse(path)[1].body
    parts = attr_path.split(".")
    node: ast.AST | None = None
    for depth, part in enumerate(parts):
        node = _names_bound(body).get(part)
        if node is None:
            return f"missing: {'.'.join(parts[: depth + 1])}"
        body = node.body if isinstance(node, ast.ClassDef) else []
    if params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found = _parameters(node, method=len(parts) > 1)
        if found[: len(params)] != list(params):
            return (
                f"signature changed: ({', '.join(found)}); the wrapper reads ({', '.join(params)})"
            )
    return PRESENT


def literal_strings(root: Path, module: str, name: str) -> tuple[str, ...] | None:
    """The strings of ``name = Literal["a", "b", ...]`` (or ``name: TypeAlias = ...``) at
    the top of ``module`` in the tree under ``root``; None where the module, the name or a
    Literal of strings is not there, or the file is not Python source."""
    path = _module_file(root, module)
    if path is None:
        return None
    try:
        tree = _parse(path)[1]
    except Unreadable:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            named = any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        elif isinstance(node, ast.AnnAssign):
            named = isinstance(node.target, ast.Name) and node.target.id == name
        else:
            continue
        value = node.value
        if not named or not isinstance(value, ast.Subscript):
            continue
        if not (isinstance(value.value, ast.Name) and value.value.id == "Literal"):
            return None
        items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
        strings = [
            i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)
        ]
        return tuple(strings) if strings and len(strings) == len(items) else None
    return None
