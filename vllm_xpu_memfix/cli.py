"""``vllm-xpu-memfix`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_xpu_memfix import __version__, compat, config, fixes


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
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
        for patch in fixes.MODULES[fix.key].PATCHES:
            status = compat.target_status(root, patch.target)
            missing += status != compat.PRESENT
            rows.append((fix.key, fix.env, settings.mode(fix.key).value, patch.target, status))
    print(_table(rows))
    return 1 if missing and args.strict else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vllm_xpu_memfix.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-xpu-memfix", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="list fixes, switches and whether their vLLM targets exist"
    )
    check.add_argument(
        "--source", help="directory holding a vllm/ source tree (default: installed vLLM)"
    )
    check.add_argument("--strict", action="store_true", help="exit 1 when a target is missing")
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser(
        "demo", help="serve a tiny local model with the plugin and show its report"
    )
    demo.add_argument("--workdir", help="keep the model and server log here (default: a temp dir)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except config.ConfigError as exc:
        print(f"vllm-xpu-memfix: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
