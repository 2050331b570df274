"""The one reader of the plugin's environment variables.

Every other module receives a :class:`Settings` object. The tables below are
the single source for the switch names, their accepted values and defaults:
``vllm-xpu-memfix check`` and the registration with vLLM's own environment table
are generated from them, and a test holds docs/switches.md's table and the README's
per-fix rows to them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core import config_paths as paths
from vllm_xpu_memfix.core.config_paths import LEDGER_OFF as LEDGER_OFF
from vllm_xpu_memfix.core.config_paths import default_ledger_dir as default_ledger_dir
from vllm_xpu_memfix.core.config_paths import default_lock_dir as default_lock_dir
from vllm_xpu_memfix.core.numbers import (
    MIB,
    SLOTS,
    TIMEOUT_S,
    Bounds,
    ConfigError,
    invalid,
    printable,
    shown,
)

PREFIX = "VLLM_XPU_MEMFIX"


class Mode(str, Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"
    # driver_env only: turn the driver's peer access off (compute-runtime #916, #980).
    NO_PEER_ACCESS = "no_peer_access"
    # preflight only: stop the start-up when the verdict is that it will not fit.
    REFUSE = "refuse"


ON_OFF_AUTO = (Mode.AUTO, Mode.ON, Mode.OFF)


@dataclass(frozen=True)
class Fix:
    """One fix of the plugin, switched by ``VLLM_XPU_MEMFIX_<KEY>`` (auto, on, off, and
    any value of its own in ``modes``, each explained in ``extra_means``)."""

    key: str
    summary: str
    auto_means: str
    modes: tuple[Mode, ...] = ON_OFF_AUTO
    extra_means: str = ""

    @property
    def env(self) -> str:
        return f"{PREFIX}_{self.key.upper()}"


Parser = Callable[["Variable", str, Mapping[str, str]], Any]


@dataclass(frozen=True)
class Variable:
    """A plugin setting: its name, its one default, and how its value is read.

    ``parse(variable, raw, environ)`` turns the raw text (the default when unset) into
    the value stored as ``Settings.<field>``, or raises :class:`ConfigError`.
    """

    name: str
    field: str
    default: str
    accepted: str
    doc: str
    parse: Parser
    choices: tuple[str, ...] = ()
    bounds: Bounds | None = None
    # Names a path on the machine that runs vLLM: checked against this filesystem only
    # where that machine is this one (``load(..., this_machine=False)``: shape only).
    path: bool = False
    # The fixes that read it: a bad value turns these off at start-up (``registration``).
    fixes: tuple[str, ...] = ()
    # A directory the plugin creates where it is missing: on this machine, the nearest part
    # of the path that exists must be a directory this user may write in.
    created: bool = False


def _choice(variable: Variable, raw: str, _environ: Mapping[str, str]) -> str:
    value = raw.strip().lower()
    if value not in variable.choices:
        raise invalid(variable.name, raw, variable.accepted)
    return value


def _switch(variable: Variable, raw: str, environ: Mapping[str, str]) -> bool:
    return _choice(variable, raw, environ) in _TRUE


def _number(variable: Variable, raw: str, _environ: Mapping[str, str]) -> float:
    assert variable.bounds is not None
    return variable.bounds.parse(variable.name, raw)


def _patterns(_variable: Variable, raw: str, _environ: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


AUTO_SLOTS = "auto"


def _slots_or_auto(variable: Variable, raw: str, environ: Mapping[str, str]) -> int | None:
    """An explicit slot count, or None for ``auto`` (sized from the host's room)."""
    if raw.strip().lower() == AUTO_SLOTS:
        return None
    assert variable.bounds is not None
    value = variable.bounds.value_of(raw)
    if value is None:
        raise invalid(variable.name, raw, variable.accepted)
    return int(value)


def _slots(kind: str, who: str, sized_by_room: bool) -> Variable:
    name = f"{PREFIX}_{kind.upper()}_SLOTS"
    doc = f"How many {who} at once on the host (or engine)."
    fix = (f"{kind}_lock",)
    if not sized_by_room:
        return Variable(
            name, f"{kind}_slots", "1", SLOTS.accepted, doc, _number, bounds=SLOTS, fixes=fix
        )
    return Variable(
        name,
        f"{kind}_slots",
        AUTO_SLOTS,
        f"{SLOTS.accepted}, or {AUTO_SLOTS}",
        f"{doc} auto: as many as the host's room holds ranks' staging, 1 with load_lock=on.",
        _slots_or_auto,
        bounds=SLOTS,
        fixes=fix,
    )


def _host_semaphore(
    kind: str, who: str, proceeds: str, timeout_s: str, sized_by_room: bool = False
) -> tuple[Variable, ...]:
    """The slots, time-out and scope of one of the plugin's host-wide locks."""
    upper = kind.upper()
    return (
        _slots(kind, who, sized_by_room),
        Variable(
            name=f"{PREFIX}_{upper}_TIMEOUT_S",
            field=f"{kind}_timeout_s",
            default=timeout_s,
            accepted=TIMEOUT_S.accepted,
            doc=f"A rank that waited this long logs a WARNING naming the holder and {proceeds} "
            "without the lock.",
            parse=_number,
            bounds=TIMEOUT_S,
            fixes=(f"{kind}_lock",),
        ),
        Variable(
            name=f"{PREFIX}_{upper}_SCOPE",
            field=f"{kind}_scope",
            default="host",
            accepted="host, instance",
            doc="host: every vLLM instance on the host shares the slots; instance: only the "
            "ranks of one engine do.",
            parse=_choice,
            choices=("host", "instance"),
            fixes=(f"{kind}_lock",),
        ),
    )


LEDGER = Fix(
    key="ledger",
    summary="Per-rank record of host memory and wall time at each start-up phase.",
    auto_means="on",
)
HOST_RELEASE = Fix(
    key="host_release",
    summary="After weights are loaded and processed, reports host tensors the model still "
    "holds, releases matching staging attributes and gives freed memory back to the OS "
    "(gc, empty_cache, malloc_trim or the tcmalloc/jemalloc equivalent).",
    auto_means="on",
)
WARMUP_LOCK = Fix(
    key="warmup_lock",
    summary="Serialises the per-rank Triton JIT warm-ups (qwen_triton_warmup and kin) behind "
    "a host-wide lock, so only one compilation holds its host memory at a time.",
    auto_means="on where the ranks share a Triton cache (eager mode); off where each rank "
    "compiles into its own (compiled mode), since waiting then saves nothing",
)
DEVICE_QUANT = Fix(
    key="device_quant",
    summary="Lets Intel's sym_int4 quantize each layer on the device with the plugin's "
    "Triton Q4_0 kernel instead of bf16 -> host fp32 -> C library -> device, after a "
    "self-check that the kernel matches the module's library bit for bit.",
    auto_means="on (the self-check always runs; any mismatch keeps the host path)",
)
KV_HEADROOM = Fix(
    key="kv_headroom",
    summary="Takes the gathered-logits buffer of the post-KV sampler warm-up plus a slack "
    "for memory outside torch out of the KV cache budget; on a device OOM in that warm-up, "
    "logs the --kv-cache-memory-bytes that would have fitted.",
    auto_means="the reserve on the XPU platform, off elsewhere; the OOM hint everywhere",
)
LOAD_LOCK = Fix(
    key="load_lock",
    summary="Lets at most N ranks of a host load their weights at once (vLLM's ignored "
    "--max-parallel-loading-workers, else VLLM_XPU_MEMFIX_LOAD_SLOTS), so the host holds "
    "about N shards of host-staged weights instead of every rank's.",
    auto_means="on where a rank stages its whole BF16 shard on the host (sym_int4's legacy "
    "load) and the host's room does not hold every rank's, or where "
    "--max-parallel-loading-workers is given; off elsewhere",
)
DRIVER_ENV = Fix(
    key="driver_env",
    summary="Sets NEOReadDebugKeys=1 EnableDeferBacking=0 so the Intel driver does not pin a "
    "host copy of device memory (compute-runtime >= 26.09, 2+ Battlemage GPUs); warns of "
    "compute-runtime #916 (2+ Intel GPUs, runtime from 25.44 to before 26.22.38646.4, kernel "
    "before 7.1).",
    auto_means="when 2+ Battlemage GPUs are visible and the runtime is affected or unknown; "
    "on: whenever the user has not set the variables",
    modes=(*ON_OFF_AUTO, Mode.NO_PEER_ACCESS),
    extra_means="no_peer_access: sets NEOReadDebugKeys=1 ForceZeDeviceCanAccessPerReturnValue=0 "
    "instead, which avoids both the host copy and #916 but costs P2P (oneCCL falls back to "
    "host-staged collectives)",
)
PREFLIGHT = Fix(
    key="preflight",
    summary="In the process that builds the engine configuration, before any worker starts, "
    "judges that configuration on this machine with the start-up model (doctor's) and logs "
    "one line: the verdict, where it runs out, the main cause and the first remedy; after a "
    "start-up killed by the kernel's OOM killer, says which process, at which phase.",
    auto_means="the line under vLLM's XPU platform (Intel GPUs) and CPU backend (host memory "
    "only), one 'not judged' line elsewhere; on: the same",
    modes=(*ON_OFF_AUTO, Mode.REFUSE),
    extra_means="refuse: also stops the start-up (one ERROR; PreflightRefused, a RuntimeError, "
    "in LLM(...); exit status 1 in vllm serve) on a certain 'will "
    "run out of memory' or 'will fail': every input read, every dimension modelled",
)
FIXES: tuple[Fix, ...] = (
    LEDGER,
    HOST_RELEASE,
    WARMUP_LOCK,
    LOAD_LOCK,
    DEVICE_QUANT,
    KV_HEADROOM,
    DRIVER_ENV,
    PREFLIGHT,
)

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")
_ON_OFF = ("on", "off")

MASTER = Variable(
    name=PREFIX,
    field="enabled",
    default="1",
    accepted="1, on, true, yes / 0, off, false, no",
    doc="Master switch. 0 patches nothing and logs one line saying the plugin is disabled.",
    parse=_switch,
    choices=_TRUE + _FALSE,
)
PARAMETERS: tuple[Variable, ...] = (
    Variable(
        name=f"{PREFIX}_LEDGER_DIR",
        field="ledger_dir",
        default="",
        accepted=f"a directory (created if missing), or {paths.LEDGER_OFF}",
        doc="Every vLLM process appends its ledger phases as JSON lines to "
        "<dir>/ledger-<hostname>-<pid>.jsonl; unset: $XDG_CACHE_HOME/vllm-xpu-memfix/ledger, "
        "else ~/.cache/vllm-xpu-memfix/ledger, where report finds the last start-up; files "
        f"older than 30 days are removed when a start-up begins. {paths.LEDGER_OFF}: no files.",
        parse=paths.ledger_dir,
        path=True,
        fixes=("ledger",),
        created=True,
    ),
    Variable(
        name=f"{PREFIX}_SYSROOT",
        field="sysroot",
        default="/",
        accepted="a directory",
        doc="Root for the sysfs, dpkg and library look-ups of the driver guard, doctor and "
        "ray-env, and for the /proc/meminfo and cgroup reads of the host's room (load lock, "
        "ledger, doctor); point it at a recorded tree. Empty is the same as unset.",
        parse=paths.existing_directory,
        path=True,
        fixes=("ledger", "load_lock", "driver_env", "preflight"),
    ),
    Variable(
        name=f"{PREFIX}_RELEASE_ATTRS",
        field="release_attrs",
        default="",
        accepted="comma-separated fnmatch patterns of module attribute names",
        doc="Plain module attributes holding host tensors that host_release deletes (e.g. "
        "'*_bf16_cpu,model.layers.*._staging'); registered parameters and buffers never match.",
        parse=_patterns,
        fixes=("host_release",),
    ),
    Variable(
        name=f"{PREFIX}_RELEASE_EVERY_MIB",
        field="release_every_mib",
        default="1024",
        accepted=MIB.accepted,
        doc="With Intel's sym_int4, give memory back after every this many MiB of per-layer "
        "host staging.",
        parse=_number,
        bounds=MIB,
        fixes=("host_release",),
    ),
    Variable(
        name=f"{PREFIX}_DROP_PAGE_CACHE",
        field="drop_page_cache",
        default="off",
        accepted="on, off",
        doc="After loading, advise the kernel to drop the checkpoint's pages from the page cache.",
        parse=_switch,
        choices=_ON_OFF,
        fixes=("host_release",),
    ),
    Variable(
        name=f"{PREFIX}_RELEASE_VOCAB_COPIES",
        field="release_vocab_copies",
        default="on",
        accepted="on, off",
        doc="On vLLM's CPU backend, host_release drops the vocabulary-matrix copies that are "
        "never read after prepacking: the input embedding's packed GEMM copy and an untied "
        "lm_head's unpacked weight (kept where LoRA, a draft model, head_dtype or the model's "
        "code may read it). No effect on XPU, where nothing is prepacked.",
        parse=_switch,
        choices=_ON_OFF,
        fixes=("host_release",),
    ),
    *_host_semaphore("warmup", "warm-ups may run", "warms up", timeout_s="900"),
    *_host_semaphore(
        "load", "ranks may load weights", "loads", timeout_s="1800", sized_by_room=True
    ),
    Variable(
        name=f"{PREFIX}_LOCK_DIR",
        field="lock_dir",
        default="",
        accepted="an absolute directory path",
        doc="Where the lock files live; default $XDG_RUNTIME_DIR/vllm-xpu-memfix, else "
        "/tmp/vllm-xpu-memfix-<uid>. Created with mode 0700; a symlink, another user's or a "
        "group/world-writable directory is refused, and so is an entry in it that is not a "
        "regular file (the warm-up or load then runs unlocked).",
        parse=paths.lock_dir,
        path=True,
        fixes=("warmup_lock", "load_lock", "device_quant"),
        created=True,
    ),
    Variable(
        name=f"{PREFIX}_KV_HEADROOM_SLACK_MIB",
        field="kv_headroom_slack_mib",
        default="256",
        accepted=MIB.accepted,
        doc="Device memory (MiB) kv_headroom keeps free besides the gathered logits, for "
        "growth outside torch after profiling (Level Zero modules, oneCCL buffers, "
        "fragmentation).",
        parse=_number,
        bounds=MIB,
        fixes=("kv_headroom",),
    ),
)


def _mode(variable: Variable, raw: str, environ: Mapping[str, str]) -> Mode:
    return Mode(_choice(variable, raw, environ))


SWITCHES: dict[str, Variable] = {
    fix.key: Variable(
        name=fix.env,
        field="modes",
        default=Mode.AUTO.value,
        accepted=", ".join(m.value for m in fix.modes),
        doc=f"{fix.summary} auto: {fix.auto_means}."
        + (f" {fix.extra_means}." if fix.extra_means else ""),
        parse=_mode,
        choices=tuple(m.value for m in fix.modes),
        fixes=(fix.key,),
    )
    for fix in FIXES
}
VARIABLES: tuple[Variable, ...] = (MASTER, *SWITCHES.values(), *PARAMETERS)


def variable_for(field: str) -> Variable:
    """The row behind ``Settings.<field>``, for messages that name the variable."""
    return next(v for v in PARAMETERS if v.field == field)


@dataclass(frozen=True)
class Settings:
    """Every plugin variable, parsed; built only by :func:`load`, so it has no defaults."""

    enabled: bool
    modes: Mapping[str, Mode]
    ledger_dir: Path | None
    sysroot: Path
    release_attrs: tuple[str, ...]
    release_every_mib: int
    drop_page_cache: bool
    release_vocab_copies: bool
    warmup_slots: int
    warmup_timeout_s: float
    warmup_scope: str
    load_slots: int | None  # None: auto, sized from the host's room
    load_timeout_s: float
    load_scope: str
    lock_dir: Path
    kv_headroom_slack_mib: int

    def mode(self, fix: Fix) -> Mode:
        return self.modes[fix.key]

    def requested(self, fix: Fix) -> bool:
        """Whether the user left the fix on (``auto`` or ``on``) and the plugin is enabled."""
        return self.enabled and self.modes[fix.key] is not Mode.OFF


def read_variable(variable: Variable, environ: Mapping[str, str], this_machine: bool = True) -> Any:
    """The value of ``variable``; :class:`ConfigError` for any value that cannot be used,
    whatever reading or checking it raised (a ``~nouser`` home, a name too long for the
    filesystem): the one guard every switch is read through."""
    raw = environ.get(variable.name, "")
    try:
        return _read(variable, raw, environ, this_machine)
    except ConfigError:
        raise
    except Exception as exc:
        raise unusable(variable.name, raw, exc) from exc


def unusable(name: str, raw: str, exc: BaseException) -> ConfigError:
    """The one-line refusal of a value whose reading raised ``exc``."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return ConfigError(f"{name}={shown(raw)} cannot be used: {printable(why.rstrip('.'), 120)}")


def _read(variable: Variable, raw: str, environ: Mapping[str, str], this_machine: bool) -> Any:
    if not raw.strip() and (variable.parse is _mode or variable is MASTER or variable.path):
        # A switch or a path left empty is unset (docker-compose's ``${X}`` of an unset X
        # is ""); an empty number is refused, as any value that is not one.
        raw = variable.default
    elif variable.name not in environ:
        raw = variable.default
    if variable.path and not this_machine and variable.parse is not paths.lock_dir:
        # Another machine's path: taken as written, never looked up here.
        return Path(raw) if raw.strip() else (Path(variable.default) if variable.default else None)
    value = variable.parse(variable, raw, environ)
    if variable.created and this_machine and raw.strip() and isinstance(value, Path):
        paths.check_creatable(variable, raw, value)
    return value


def load(environ: Mapping[str, str] | None = None, this_machine: bool = True) -> Settings:
    """Read and validate every plugin variable. Raises :class:`ConfigError` on bad input.

    ``this_machine=False`` reads another machine's variables (``doctor --host``): a path
    variable is checked for its shape only, never against this filesystem."""
    env = os.environ if environ is None else environ
    return Settings(
        enabled=read_variable(MASTER, env),
        modes={key: read_variable(switch, env) for key, switch in SWITCHES.items()},
        **{variable.field: read_variable(variable, env, this_machine) for variable in PARAMETERS},
    )
