"""Which fixes apply to which vLLM release: a static scan of each release's Python files.

Downloads the vLLM wheels (``pip download --no-deps``; nothing is installed or
imported), unpacks only their ``.py`` files and runs the same scan as
``vllm-xpu-memfix check --source`` on each (``cli.check.targets``: every target of every
fix, the platform workers' own overrides included), plus the installed test bed. Writes
the matrix as markdown; ``tests/test_compat.py`` holds its rows to ``check``'s targets.

    python benchmarks/compat_matrix.py --out docs/compat.md
    python benchmarks/compat_matrix.py --versions 0.33.0 0.34.0 --cache /tmp/vllm-wheels
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from vllm_xpu_memfix.cli import check, compat
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.fixes import warmup_lock
from vllm_xpu_memfix.vllm_code import overrides, warmup_section

PROSE_HEADING = "## Reading it"
VERSIONS = (
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def source_tree(version: str, cache: Path) -> Path:
    """``cache/<version>/src`` holding the release's ``vllm/**.py``; downloaded once."""
    tree = cache / version / "src"
    if (tree / "vllm").is_dir():
        return tree
    wheels = cache / version / "wheel"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            f"vllm=={version}",
            "-d",
            str(wheels),
        ],
        check=True,
    )
    wheel = next(wheels.glob("vllm-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        archive.extractall(tree, names)
    wheel.unlink()  # ~300 MB each; the .py files are all the scan needs
    return tree


def sampler_warmup_after_kv(root: Path) -> bool:
    """Whether ``Worker.compile_or_warm_up_model`` (or its ``_compile_or_warm_up_model``
    helper, 0.33 on) still calls ``_dummy_sampler_run``: the post-KV burst that
    kv_headroom reserves for."""
    path = root / "vllm" / "v1" / "worker" / "gpu_worker.py"
    if not path.is_file():
        return False
    warm_ups = [
        node
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef) and node.name.endswith("compile_or_warm_up_model")
    ]
    return any(
        isinstance(call, ast.Attribute) and call.attr == "_dummy_sampler_run"
        for function in warm_ups
        for call in ast.walk(function)
    )


def warm_up_section(root: Path) -> warmup_section.Section:
    path = root / "vllm" / "model_executor" / "warmup" / "kernel_warmup.py"
    if not path.is_file():
        return warmup_section.Section((), "no kernel_warmup module")
    return warmup_section.process_local_section(path.read_text(encoding="utf-8"))


def warm_up_coverage(trees: dict[str, Path]) -> str:
    """What the warm-up lock holds its slot over, per release."""
    rows = ["| release | the slot covers | collectives in it |", "|---|---|---|"]
    for name, root in trees.items():
        found = warm_up_section(root)
        if found.usable:
            covers = "kernel_warmup's process-local section: " + ", ".join(
                f"`{call}`" for call in found.warm_ups
            )
            collectives = ", ".join(found.collectives) or "none"
        else:
            covers = f"the allow-list only ({found.why_not})"
            collectives = "-"
        rows.append(f"| {name} | {covers} | {collectives} |")
    return "\n".join(rows)


def cell(target: check.Target | None) -> str:
    if target is None:
        return "-"  # not a target here: a platform worker without its own override
    if target.word == check.PRESENT:
        return "✓"
    if target.detail.endswith("(Intel's images only)"):
        return "Intel only"
    if target.word == check.ABSENT:
        return "elsewhere" if "has it at" in target.detail else "absent (optional)"
    return target.detail.replace("|", "/").upper()


def fix_summary(found: list[check.Target]) -> str:
    """One word per fix and release, from its targets' words."""
    upstream = [t for t in found if not t.detail.endswith("(Intel's images only)")]
    if not found:
        return "applies (no vLLM target)"
    if not upstream:
        return "Intel images only"
    missing = sum(t.word == check.MISSING for t in upstream)
    absent = sum(t.word == check.ABSENT for t in upstream)
    if missing:
        return f"MISSING {missing} of {len(upstream)} targets"
    return f"applies ({absent} optional absent)" if absent else "applies"


def read_or_raise(read: Callable[[], str]) -> str:
    return read()


def matrix(trees: dict[str, Path]) -> str:
    columns = list(trees)
    settings = config.load({})
    found: dict[str, list[check.Target]] = {}
    for name, root in trees.items():
        workers = check.platform_overrides(root, settings)
        own = {f"{w}.{m}" for w, m, kind in workers if kind != overrides.INHERITS}
        found[name] = check.targets(root, settings, own, read_or_raise)
    lines = [
        "| fix | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    detail = [
        "| fix | target | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for fix in config.FIXES:
        lines.append(
            f"| `{fix.key}` | "
            + " | ".join(fix_summary([t for t in found[c] if t.fix == fix.key]) for c in columns)
            + " |"
        )
        rows = dict.fromkeys(t.target for c in columns for t in found[c] if t.fix == fix.key)
        for target in rows:
            by_column = {
                c: next((t for t in found[c] if (t.fix, t.target) == (fix.key, target)), None)
                for c in columns
            }
            cells = " | ".join(cell(by_column[c]) for c in columns)
            detail.append(f"| `{fix.key}` | `{target}` | {cells} |")
    probe = " | ".join("yes" if sampler_warmup_after_kv(trees[c]) else "no" for c in columns)
    lines.append(
        f"| (kv_headroom's burst: `compile_or_warm_up_model` runs the sampler) | {probe} |"
    )
    return (
        "\n".join(lines)
        + "\n\nPer target (`-`: a platform worker's method it does not override there):\n\n"
        + "\n".join(detail)
        + "\n\nWhat the warm-up lock covers (`kernel_warmup` up to `if process_local_only: "
        "return`, where that line exists; otherwise the allow-list "
        f"{', '.join(warmup_lock.ALLOWED)}):\n\n" + warm_up_coverage(trees)
    )


def kept_prose(out: Path) -> str:
    """The hand-written part of an existing ``out``, from its ``## Reading it`` on: the
    tables above it are generated, the reading of them is not."""
    text = out.read_text() if out.is_file() else ""
    start = text.find(PROSE_HEADING)
    return "\n" + text[start:] if start >= 0 else ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--versions", nargs="+", default=VERSIONS)
    parser.add_argument("--cache", type=Path, help="keep the unpacked sources here")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: stdout)")
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="vllm-compat-"))
    trees: dict[str, Path] = {}
    for version in args.versions:
        started = time.perf_counter()
        print(f"vLLM {version}: fetching and unpacking ...", file=sys.stderr, flush=True)
        trees[version] = source_tree(version, cache)
        print(f"vLLM {version}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    installed = compat.installed_vllm_root()
    if installed is not None:
        trees["test bed"] = installed
    table = matrix(trees)
    if args.out:
        args.out.write_text(table + "\n" + kept_prose(args.out))
    else:
        print(table)


if __name__ == "__main__":
    main()
