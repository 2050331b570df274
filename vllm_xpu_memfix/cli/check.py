"""``vllm-xpu-memfix check``: fixes, switches and whether their vLLM targets exist."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_xpu_memfix import __version__, config, fixes
from vllm_xpu_memfix.cli import compat


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    settings = config.load()
    root = Path(args.source) if args.source else compat.installed_vllm_root()
    if root is None:
        print("vLLM is not installed in this environment; pass --source DIR to scan a source tree.")
        return 2
    if not (root / "vllm").is_dir():
        print(f"{root} holds no vllm/ package directory.", file=sys.stderr)
        return 2
    print(
        f"vllm-xpu-memfix {__version__}; plugin {'enabled' if settings.enabled else 'DISABLED'}"
        f" ({config.MASTER.name}); vLLM source: {root / 'vllm'}\n"
    )
    rows = [("fix", "switch", "value", "target", "status")]
    missing = 0
    for fix in config.FIXES:
        value = settings.mode(fix).value
        patches = fixes.module_of(fix).patches(settings)
        if not patches:
            rows.append((fix.key, fix.env, value, "(none: acts at registration)", "-"))
        for patch in patches:
            status = compat.target_status(root, patch.target, patch.params)
            missing += status != compat.PRESENT and patch.module not in compat.INTEL_IMAGE_MODULES
            rows.append((fix.key, fix.env, value, patch.target, status))
    print(_table(rows))
    print()
    removal = [("fix", "remove when", "upstream")]
    for fix in config.FIXES:
        rule = fixes.module_of(fix).REMOVE_WHEN
        removal.append(
            (fix.key, rule.change, rule.evaluate(lambda m: compat.module_source(root, m)))
        )
    print(_table(removal))
    return 1 if missing and args.strict else 0
