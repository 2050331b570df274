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
    print(f"\nsym_int4: {sym_int4_layout(root)}")
    return 1 if missing and args.strict else 0


def sym_int4_layout(root: Path) -> str:
    """The installed sym_int4's layout, read from its source, and what device_quant does."""
    from vllm_xpu_memfix import int4_layouts
    from vllm_xpu_memfix.fixes import device_quant

    source = compat.module_source(root, device_quant.MODULE)
    if source is None:
        return "not installed (Intel's images only): device_quant has nothing to act on"
    return int4_layouts.recognise(int4_layouts.shape_of_source(source)).summary
