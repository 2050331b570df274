"""The package's layering, read from its source: every import points down.

A module's imports of the package are read with ``ast`` (function-level imports
included, since the plugin imports lazily), so a new module that imports upward, or a
fix that leans on another fix, fails here before it can turn into a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_xpu_memfix"
# Which parts of the package each part may import (itself always).
MAY_IMPORT = {
    "core": set(),
    "kernels": set(),
    "vllm_code": {"core"},
    "memory": {"core"},
    "intel": {"core", "kernels", "memory"},
    "startup": {"core", "vllm_code", "intel", "memory"},
    "fixes": {"core", "vllm_code", "intel", "memory", "kernels", "startup"},
    "cli": {"core", "vllm_code", "intel", "memory", "kernels", "startup", "fixes", "__init__"},
}
LINE_LIMIT = 500


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path) -> dict[str, int]:
    """The package parts ``path`` imports, with the first line of each."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE.name:
                names = [f"{PACKAGE.name}.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == PACKAGE.name and len(parts) > 1:
                part = parts[1] if parts[1] != "__version__" else "__init__"
                found.setdefault(part, node.lineno)
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def test_the_root_holds_only_the_entry_point_and_sub_packages():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules at the package root: {loose}; give each a sub-package"
    assert set(MAY_IMPORT) == {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    part = part_of(path)
    allowed = MAY_IMPORT[part] | {part}
    upward = {k: v for k, v in imported_parts(path).items() if k not in allowed}
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward} (part:line)"


@pytest.mark.parametrize("path", sorted((PACKAGE / "fixes").glob("*.py")), ids=lambda p: p.name)
def test_a_fix_does_not_lean_on_another_fix(path):
    if path.name == "__init__.py":
        pytest.skip("the registry lists every fix")
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            f"{PACKAGE.name}.fixes"
        ):
            pytest.fail(f"{path.name}:{node.lineno} imports {node.module}: share it via memory/")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_module_is_over_the_line_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LINE_LIMIT, f"{path.relative_to(PACKAGE)}: {lines} lines; split it"


def test_each_sub_package_says_what_belongs_there():
    for part in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 2, f"{part}/__init__.py needs its two lines"
