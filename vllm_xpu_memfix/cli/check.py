"""``vllm-xpu-memfix check``: fixes, switches and whether their vLLM targets exist, and
the decision the driver guard makes on this host (as ``driver_env`` logs it)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from vllm_xpu_memfix import __version__, fixes
from vllm_xpu_memfix.cli import compat
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.lines import wrap, wrapped
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import int4_self_check
from vllm_xpu_memfix.vllm_code import overrides
from vllm_xpu_memfix.vllm_code.overrides import INHERITS

# A target's first word: present; absent, where the release lacks an optional target (it
# has another of its group, or lacks the code path); missing, which --strict counts.
PRESENT, ABSENT, MISSING = "present", "absent", "missing"


@dataclass(frozen=True)
class Target:
    fix: str
    target: str
    word: str  # PRESENT, ABSENT or MISSING
    detail: str  # what the source shows where the word is not PRESENT


def platform_overrides(root: Path, settings: config.Settings) -> list[tuple[str, str, str]]:
    """(worker, method, kind) for each patched ``Worker`` method per platform worker of
    the tree under ``root`` (``overrides.scan``); raises :class:`compat.Unreadable`."""
    methods = overrides.patched_worker_methods(fixes.all_patches(settings))
    return overrides.scan(methods, partial(compat.module_source, root))


def targets(
    root: Path,
    settings: config.Settings,
    overridden: set[str],
    read: Callable[[Callable[[], str]], str],
) -> list[Target]:
    """Every fix's targets as installed (with the platform workers' own overrides in
    ``overridden``) and how the tree under ``root`` has each; ``read`` runs a reader of
    the source and turns an unreadable file into a status."""
    found: list[Target] = []
    for fix in config.FIXES:
        patches = [
            patch
            for patch in fixes.patches_of(fixes.module_of(fix), settings)
            if not patch.own_only or patch.target in overridden
        ]
        statuses = {
            patch.target: read(partial(compat.target_status, root, patch.target, patch.params))
            for patch in patches
        }
        for patch in patches:
            status = statuses[patch.target]
            if status == compat.PRESENT:
                found.append(Target(fix.key, patch.target, PRESENT, ""))
                continue
            group = [p.target for p in patches if p.group and p.group == patch.group]
            serving = [t for t in group if statuses[t] == compat.PRESENT]
            if patch.module in compat.INTEL_IMAGE_MODULES:
                found.append(Target(fix.key, patch.target, ABSENT, status))
            elif serving:
                where = f"{status}; this release has it at {serving[0]}"
                found.append(Target(fix.key, patch.target, ABSENT, where))
            elif patch.optional and not group:
                why = "optional: this release lacks that code path, the fix acts without it"
                found.append(Target(fix.key, patch.target, ABSENT, f"{status}; {why}"))
            else:
                found.append(Target(fix.key, patch.target, MISSING, status))
    return found


def main(args: argparse.Namespace) -> int:
    settings = config.load()
    if args.source is not None and not args.source.strip():
        print("check: --source is empty; give the directory that holds vllm/", file=sys.stderr)
        return 2
    root = Path(args.source) if args.source is not None else compat.installed_vllm_root()
    if root is None:
        print(
            "check: vLLM is not installed in this environment; pass --source DIR to scan a "
            "source tree.",
            file=sys.stderr,
        )
        return 2
    if not (root / "vllm").is_dir():
        print(f"check: {root} holds no vllm/ package directory.", file=sys.stderr)
        return 2
    head = (
        f"vllm-xpu-memfix {__version__}; plugin {'enabled' if settings.enabled else 'DISABLED'}"
        f" ({config.MASTER.name}); vLLM source: {root / 'vllm'}"
    )
    print("\n".join(wrap(head)) + "\n")
    unreadable: dict[Path, str] = {}

    def readable(read: Callable[[], str]) -> str:
        try:
            return read()
        except compat.Unreadable as exc:
            unreadable[exc.path] = exc.reason
            return "unreadable (see below)"

    try:
        workers = platform_overrides(root, settings)
    except compat.Unreadable as exc:
        unreadable[exc.path] = exc.reason
        workers = []
    overridden = {f"{worker}.{method}" for worker, method, kind in workers if kind != INHERITS}
    found = targets(root, settings, overridden, readable)
    lines: list[str] = []
    for fix in config.FIXES:
        rule = fixes.module_of(fix).REMOVE_WHEN
        upstream = readable(partial(rule.evaluate, partial(compat.module_source, root)))
        lines.append(f"{fix.key} ({fix.env}={settings.mode(fix).value})")
        mine = [target for target in found if target.fix == fix.key]
        if not mine:
            lines.append(f"  {'-':<8} (no vLLM target: acts at registration)")
        for target in mine:
            lines.append(f"  {target.word:<8} {target.target}")
            if target.detail:
                lines.extend(wrap(f"{'':10} {target.detail}", hang=11))
        lines.extend(wrap(f"  remove when {rule.change}: {upstream}", hang=11))
    print("\n".join(lines))
    decision, *guard = driver_env.summary_lines(driver_env.decide(settings, os.environ))
    missing = [target for target in found if target.word == MISSING]
    prose = [
        "",
        f"targets: {len(found) - len(missing)} of {len(found)} present or not needed here"
        + (f"; {len(missing)} missing" if missing else ""),
        f"sym_int4: {readable(partial(sym_int4_layout, root))}",
        f"device_quant self-check: {int4_self_check.describe(settings.lock_dir)}",
        f"driver_env: {decision}",
        *(f"  {line}" for line in guard),
        "",
        *platform_workers(workers).splitlines(),
        *(f"unreadable: {path}: {reason}" for path, reason in unreadable.items()),
    ]
    print("\n".join(wrapped(prose)))
    return 1 if missing and args.strict else 0


def platform_workers(rows: list[tuple[str, str, str]]) -> str:
    """Per platform worker: which patched ``Worker`` methods it overrides, and how."""
    lines = ["platform workers (patched Worker methods they override):"]
    for worker in overrides.PLATFORM_WORKERS:
        kinds = {method: kind for w, method, kind in rows if w == worker}
        if overrides.ABSENT in kinds.values():
            lines.append(f"  {worker}: not in this vLLM")
            continue
        own = [(method, kind) for method, kind in kinds.items() if kind != INHERITS]
        if not own:
            lines.append(f"  {worker}: inherits every one")
        for method, kind in own:
            effect = {
                overrides.WITHOUT_SUPER: "the fixes patch the override too",
                overrides.CALLS_SUPER: "patched there too; the fix acts once per call",
            }.get(kind, "")
            lines.append(f"  {worker}.{method}: {kind}" + (f" ({effect})" if effect else ""))
    return "\n".join(lines)


def sym_int4_layout(root: Path) -> str:
    """The installed sym_int4's layout, read from its source, and what device_quant does."""
    from vllm_xpu_memfix.fixes import device_quant
    from vllm_xpu_memfix.intel import int4_layouts

    source = compat.module_source(root, device_quant.MODULE)
    if source is None:
        return "not installed (Intel's images only): device_quant has nothing to act on"
    return int4_layouts.recognise(int4_layouts.shape_of_source(source)).summary
