"""The one reader of the plugin's environment variables.

Every other module receives a :class:`Settings` object. The tables below are
the single source for the switch names, their accepted values and defaults:
``vllm-xpu-memfix check`` and the registration with vLLM's own environment table
are generated from them, and a test holds the README's switch table to them.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

PREFIX = "VLLM_XPU_MEMFIX"


def default_lock_dir(environ: Mapping[str, str] = os.environ) -> Path:
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "vllm-xpu-memfix"
    return Path(f"/tmp/vllm-xpu-memfix-{os.geteuid()}")


class ConfigError(ValueError):
    """A ``VLLM_XPU_MEMFIX*`` variable holds a value the plugin does not accept."""


class Mode(str, Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True)
class Fix:
    """One fix of the plugin, switched by ``VLLM_XPU_MEMFIX_<KEY>``."""

    key: str
    summary: str
    auto_means: str

    @property
    def env(self) -> str:
        return f"{PREFIX}_{self.key.upper()}"


@dataclass(frozen=True)
class Variable:
    """A plugin setting: the master switch, a fix switch or a parameter of a fix."""

    name: str
    default: str
    accepted: str
    doc: str
    choices: tuple[str, ...] = ()


FIXES: tuple[Fix, ...] = (
    Fix(
        key="ledger",
        summary="Per-rank record of host memory and wall time at each start-up phase.",
        auto_means="on",
    ),
    Fix(
        key="host_release",
        summary="After weights are loaded and processed, reports host tensors the model still "
        "holds, releases matching staging attributes and gives freed memory back to the OS "
        "(gc, empty_cache, malloc_trim or the tcmalloc/jemalloc equivalent).",
        auto_means="on",
    ),
    Fix(
        key="warmup_lock",
        summary="Serialises the per-rank Triton JIT warm-ups (qwen_triton_warmup and kin) behind "
        "a host-wide lock, so only one compilation holds its host memory at a time.",
        auto_means="on where the ranks share a Triton cache (eager mode); off where each rank "
        "compiles into its own (compiled mode), since waiting then saves nothing",
    ),
    Fix(
        key="device_quant",
        summary="Lets Intel's sym_int4 quantize each layer on the device with the plugin's "
        "Triton Q4_0 kernel instead of bf16 -> host fp32 -> C library -> device, after a "
        "self-check that the kernel matches the module's library bit for bit.",
        auto_means="on (the self-check always runs; any mismatch keeps the host path)",
    ),
    Fix(
        key="kv_headroom",
        summary="Takes the gathered-logits buffer of the post-KV sampler warm-up plus a slack "
        "out of the KV cache budget, so that warm-up cannot run the device out of memory; on a "
        "device OOM there, logs the --kv-cache-memory-bytes that would have fitted.",
        auto_means="the reserve on the XPU platform, off elsewhere; the OOM hint everywhere",
    ),
    Fix(
        key="driver_env",
        summary="Sets NEOReadDebugKeys=1 EnableDeferBacking=0 so the Intel driver does not pin a "
        "host mirror of device memory (compute-runtime >= 26.09, 2+ Battlemage GPUs).",
        auto_means="when 2+ Battlemage GPUs are visible and the runtime is affected or unknown; "
        "on: whenever the user has not set the variables",
    ),
)

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")

MASTER = Variable(
    name=PREFIX,
    default="1",
    accepted="1, on, true, yes / 0, off, false, no",
    doc="Master switch. 0 patches nothing and logs one line saying the plugin is disabled.",
    choices=_TRUE + _FALSE,
)
LEDGER_DIR = Variable(
    name=f"{PREFIX}_LEDGER_DIR",
    default="",
    accepted="a directory (created if missing)",
    doc="Every vLLM process appends its ledger phases as JSON lines to "
    "<dir>/ledger-<hostname>-<pid>.jsonl.",
)
SYSROOT = Variable(
    name=f"{PREFIX}_SYSROOT",
    default="/",
    accepted="a directory",
    doc="Root for the sysfs, dpkg and library look-ups of the driver guard and doctor "
    "(point it at a recorded tree).",
)

RELEASE_ATTRS = Variable(
    name=f"{PREFIX}_RELEASE_ATTRS",
    default="",
    accepted="comma-separated fnmatch patterns of module attribute names",
    doc="Plain module attributes holding host tensors that host_release deletes (e.g. "
    "'*_bf16_cpu,model.layers.*._staging'); registered parameters and buffers never match.",
)
RELEASE_EVERY_MIB = Variable(
    name=f"{PREFIX}_RELEASE_EVERY_MIB",
    default="1024",
    accepted="an integer >= 0 (0: only after loading)",
    doc="With Intel's sym_int4, give memory back after every this many MiB of per-layer "
    "host staging.",
)
DROP_PAGE_CACHE = Variable(
    name=f"{PREFIX}_DROP_PAGE_CACHE",
    default="off",
    accepted="on, off",
    doc="After loading, advise the kernel to drop the checkpoint's pages from the page cache.",
    choices=("on", "off"),
)
RELEASE_VOCAB_COPIES = Variable(
    name=f"{PREFIX}_RELEASE_VOCAB_COPIES",
    default="on",
    accepted="on, off",
    doc="On vLLM's CPU backend, host_release drops the vocabulary-matrix copies that are never "
    "read after prepacking: the input embedding's packed GEMM copy and an untied lm_head's "
    "unpacked weight (kept where LoRA, a draft model, head_dtype or the model's code may read "
    "it). No effect on XPU, where nothing is prepacked.",
    choices=("on", "off"),
)
WARMUP_SLOTS = Variable(
    name=f"{PREFIX}_WARMUP_SLOTS",
    default="1",
    accepted="an integer >= 1",
    doc="How many warm-ups may run at once on the host (or engine).",
)
WARMUP_TIMEOUT_S = Variable(
    name=f"{PREFIX}_WARMUP_TIMEOUT_S",
    default="900",
    accepted="seconds > 0",
    doc="A rank that waited this long logs a WARNING naming the holder and warms up without "
    "the lock.",
)
WARMUP_SCOPE = Variable(
    name=f"{PREFIX}_WARMUP_SCOPE",
    default="host",
    accepted="host, instance",
    doc="host: every vLLM instance on the host shares the slots; instance: only the ranks of "
    "one engine do.",
    choices=("host", "instance"),
)
KV_HEADROOM_SLACK_MIB = Variable(
    name=f"{PREFIX}_KV_HEADROOM_SLACK_MIB",
    default="256",
    accepted="an integer >= 0",
    doc="Device memory (MiB) kv_headroom keeps free besides the gathered logits, for growth "
    "outside torch after profiling (Level Zero modules, oneCCL buffers, fragmentation).",
)
LOCK_DIR = Variable(
    name=f"{PREFIX}_LOCK_DIR",
    default="",
    accepted="an absolute directory path",
    doc="Where the lock files live; default $XDG_RUNTIME_DIR/vllm-xpu-memfix, else "
    "/tmp/vllm-xpu-memfix-<uid>. Created with mode 0700; a symlink, another user's or a "
    "group/world-writable directory is refused.",
)

VARIABLES: tuple[Variable, ...] = (
    MASTER,
    *(
        Variable(
            name=fix.env,
            default=Mode.AUTO.value,
            accepted=", ".join(m.value for m in Mode),
            doc=f"{fix.summary} auto: {fix.auto_means}.",
            choices=tuple(m.value for m in Mode),
        )
        for fix in FIXES
    ),
    LEDGER_DIR,
    SYSROOT,
    RELEASE_ATTRS,
    RELEASE_EVERY_MIB,
    DROP_PAGE_CACHE,
    RELEASE_VOCAB_COPIES,
    WARMUP_SLOTS,
    WARMUP_TIMEOUT_S,
    WARMUP_SCOPE,
    LOCK_DIR,
    KV_HEADROOM_SLACK_MIB,
)


@dataclass(frozen=True)
class Settings:
    enabled: bool
    modes: Mapping[str, Mode]
    ledger_dir: Path | None = None
    sysroot: Path = Path("/")
    release_attrs: tuple[str, ...] = ()
    release_every_mib: int = 1024
    drop_page_cache: bool = False
    release_vocab_copies: bool = True
    warmup_slots: int = 1
    warmup_timeout_s: float = 900.0
    warmup_scope: str = "host"
    lock_dir: Path = field(default_factory=default_lock_dir)
    kv_headroom_slack_mib: int = 256

    def mode(self, fix_key: str) -> Mode:
        return self.modes[fix_key]

    def requested(self, fix_key: str) -> bool:
        """Whether the user left the fix on (``auto`` or ``on``) and the plugin is enabled."""
        return self.enabled and self.modes[fix_key] is not Mode.OFF


def _invalid(name: str, value: str, accepted: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is not valid; accepted values: {accepted}")


def _parse_master(environ: Mapping[str, str]) -> bool:
    raw = environ.get(MASTER.name, MASTER.default)
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _invalid(MASTER.name, raw, MASTER.accepted)


def _parse_mode(fix: Fix, environ: Mapping[str, str]) -> Mode:
    raw = environ.get(fix.env, Mode.AUTO.value)
    try:
        return Mode(raw.strip().lower())
    except ValueError:
        raise _invalid(fix.env, raw, ", ".join(m.value for m in Mode)) from None


def _parse_directory(variable: Variable, environ: Mapping[str, str]) -> Path | None:
    raw = environ.get(variable.name, variable.default)
    if not raw.strip():
        return None
    path = Path(raw).expanduser()
    if path.exists() and not path.is_dir():
        raise _invalid(variable.name, raw, f"{variable.accepted}; this path is not a directory")
    return path


def _parse_number(variable: Variable, environ: Mapping[str, str], *, integer: bool,
                  minimum: float) -> float:  # fmt: skip
    raw = environ.get(variable.name, variable.default)
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise _invalid(variable.name, raw, variable.accepted) from None
    if value < minimum or (not integer and value == minimum == 0.0):
        raise _invalid(variable.name, raw, variable.accepted)
    return value


def _parse_choice(variable: Variable, environ: Mapping[str, str]) -> str:
    raw = environ.get(variable.name, variable.default)
    if raw.strip().lower() not in variable.choices:
        raise _invalid(variable.name, raw, variable.accepted)
    return raw.strip().lower()


def _parse_lock_dir(environ: Mapping[str, str]) -> Path:
    raw = environ.get(LOCK_DIR.name, "")
    if not raw.strip():
        return default_lock_dir(environ)
    if not os.path.isabs(raw):
        raise _invalid(LOCK_DIR.name, raw, LOCK_DIR.accepted)
    return Path(raw)


def _parse_sysroot(environ: Mapping[str, str]) -> Path:
    raw = environ.get(SYSROOT.name, SYSROOT.default)
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise _invalid(SYSROOT.name, raw, "an existing directory")
    return path


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every plugin variable. Raises :class:`ConfigError` on bad input."""
    env = os.environ if environ is None else environ
    return Settings(
        enabled=_parse_master(env),
        modes={fix.key: _parse_mode(fix, env) for fix in FIXES},
        ledger_dir=_parse_directory(LEDGER_DIR, env),
        sysroot=_parse_sysroot(env),
        release_attrs=tuple(
            p.strip() for p in env.get(RELEASE_ATTRS.name, "").split(",") if p.strip()
        ),
        release_every_mib=int(_parse_number(RELEASE_EVERY_MIB, env, integer=True, minimum=0)),
        drop_page_cache=_parse_choice(DROP_PAGE_CACHE, env) == "on",
        release_vocab_copies=_parse_choice(RELEASE_VOCAB_COPIES, env) == "on",
        warmup_slots=int(_parse_number(WARMUP_SLOTS, env, integer=True, minimum=1)),
        warmup_timeout_s=_parse_number(WARMUP_TIMEOUT_S, env, integer=False, minimum=0.0),
        warmup_scope=_parse_choice(WARMUP_SCOPE, env),
        lock_dir=_parse_lock_dir(env),
        kv_headroom_slack_mib=int(
            _parse_number(KV_HEADROOM_SLACK_MIB, env, integer=True, minimum=0)
        ),
    )


def announce_to_vllm() -> None:
    """Add the plugin's variables to vLLM's environment table.

    vLLM warns about every ``VLLM_*`` variable missing from
    ``vllm.envs.environment_variables``. Versions without that table are left
    alone. Note that vLLM hashes the known variables into its torch.compile
    cache key, so changing a plugin switch also starts a fresh compile cache.
    """
    envs = sys.modules.get("vllm.envs")
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for variable in VARIABLES:
        table.setdefault(
            variable.name, functools.partial(os.environ.get, variable.name, variable.default)
        )
