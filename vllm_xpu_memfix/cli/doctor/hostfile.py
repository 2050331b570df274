"""A machine described in a TOML file (``doctor --host FILE``): read and checked.

Every key is optional except the GPUs (``[[gpu]]`` tables, or ``gpu = []`` for a machine
without an Intel GPU); what is absent is unknown, and :attr:`Described.assumed` says what
doctor took instead. A value doctor cannot take is a :class:`HostFileError`: one line
naming the key and what is accepted. docs/doctor.md documents the keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.cli.doctor import target
from vllm_xpu_memfix.core import bounded, files
from vllm_xpu_memfix.core.numbers import Bounds, shown
from vllm_xpu_memfix.core.units import GiB, size
from vllm_xpu_memfix.intel import catalog, driver

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib


class HostFileError(ValueError):
    """A host file doctor cannot take; the message is one line."""


RAM = Bounds(0, 65536, above_minimum=True, unit="GiB")
SIZE = Bounds(0, 65536, unit="GiB")
GPU_MEMORY = Bounds(1, 1024, unit="GiB")  # no Intel GPU has less than 1 GiB
GPU_COUNT = Bounds(1, 64, integer=True)
MAX_GPUS = 64
# A host file is a few KiB (doctor --write-host writes about 1); anything larger is not one.
HOST_FILE_CAP = 1024**2
# A host file names a few devices and figures: anything larger is not one.
HOST_LIMITS = bounded.Limits(depth=8, digits=20, string=HOST_FILE_CAP, values=10_000)
# MemAvailable where only MemTotal is given: the OS and other processes keep this share.
OS_SHARE = 0.05
OS_SHARE_MIN_GIB = 2.0

TABLES: dict[str, tuple[str, ...] | None] = {
    "host": (
        "ram_gib",
        "available_gib",
        "swap_gib",
        "cgroup_limit_gib",
        "cgroup_used_gib",
        "kernel",
        "p2p",
    ),
    "gpu": ("model", "pci_id", "count", "memory_gib"),
    "driver": ("compute_runtime",),
    "image": ("name", "sym_int4_layouts"),
    "env": None,  # any variable name
    "plugin": ("installed",),
}
# The [env] names a host file takes (and --write-host writes).
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class GpuKind:
    name: str
    device_id: int
    count: int
    memory_bytes: int | None


@dataclass(frozen=True)
class Described:
    path: str
    ram: int | None
    available: int | None
    swap: int | None
    cgroup_limit: int | None
    cgroup_used: int | None
    kernel: driver.Kernel | None
    p2p: bool | None
    gpus: tuple[GpuKind, ...]
    runtime: driver.Runtime | None
    image: catalog.Image | None
    int4_layouts: int | None
    env: dict[str, str]
    plugin: bool
    assumed: tuple[str, ...]


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, where: str, message: str) -> HostFileError:
        return HostFileError(f"{self.path}: {where}: {message}".replace("\n", "\\n"))

    def number(self, where: str, value: Any, bounds: Bounds) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        number = bounds.value_of(repr(value)) if ok else None
        if number is None:
            shown_value = repr(value) if ok else shown(str(value))
            raise self.error(where, f"{shown_value} is not valid; accepted: {bounds.accepted}")
        return float(number)

    def text(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.error(where, f"{shown(str(value))} is not valid; accepted: a string")
        return value.strip()


def load(path: str | Path, image: str | None = None) -> Described:
    """Read and check the host file at ``path``; ``image``: ``--image``'s name, the same
    input as the file's ``[image] name`` (``target.image_of``)."""
    name = str(path)
    try:
        raw = files.read_input(path, HOST_FILE_CAP)
    except files.InputRefused as exc:
        raise HostFileError(f"{name}: {exc}") from None
    if sum(raw.count(mark) for mark in b",=[{") > HOST_LIMITS.values:  # before tomllib's slow parse
        raise HostFileError(f"{name}: more than {HOST_LIMITS.values:,} values; not a host file")
    try:
        data = tomllib.loads(raw.decode("utf-8-sig"))  # an editor's byte-order mark
        bounded.check(data, HOST_LIMITS)
    except UnicodeDecodeError:
        raise HostFileError(f"{name}: is not UTF-8 text, so not TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise HostFileError(f"{name}: is not TOML ({exc})".replace("\n", " ")) from None
    except bounded.OutOfBounds as exc:
        raise HostFileError(f"{name}: {exc.reason}; not a host file") from None
    except (RecursionError, ValueError):
        # tomllib recurses once per nesting level and converts digits of any length.
        raise HostFileError(f"{name}: nested or numbered beyond a host file") from None
    return parse(data, name, image)


def _check_keys(reader: _Reader, data: dict[str, Any]) -> None:
    for table, value in data.items():
        if table not in TABLES:
            raise reader.error(
                shown(table), f"unknown key; accepted tables: {', '.join(sorted(TABLES))}"
            )
        keys = TABLES[table]
        if table == "gpu":
            if not isinstance(value, list):
                raise reader.error("gpu", "accepted: [[gpu]] tables, or gpu = [] for none")
            entries = value
        elif not isinstance(value, dict):
            raise reader.error(table, f"is a {type(value).__name__}; accepted: a [{table}] table")
        else:
            entries = [value]
        for entry in entries:
            if not isinstance(entry, dict):
                raise reader.error(table, "accepted: a table of keys")
            for key in entry:
                if keys is not None and key not in keys:
                    raise reader.error(
                        f"[{table}] {shown(key)}", f"unknown key; accepted: {', '.join(keys)}"
                    )


def _gib(reader: _Reader, table: dict[str, Any], key: str, bounds: Bounds) -> int | None:
    if key not in table:
        return None
    return int(reader.number(f"[host] {key}", table[key], bounds) * GiB)


def _host(reader: _Reader, table: dict[str, Any], assumed: list[str]) -> dict[str, Any]:
    ram = _gib(reader, table, "ram_gib", RAM)
    available = _gib(reader, table, "available_gib", SIZE)
    if ram is not None and available is not None and available > ram:
        raise reader.error("[host] available_gib", "is above ram_gib; accepted: at most ram_gib")
    if available is None and ram is not None:
        share = max(OS_SHARE * ram, OS_SHARE_MIN_GIB * GiB)
        available = max(0, int(ram - share))
        assumed.append(
            f"available_gib not given: ram_gib less {size(share)} for the OS and other "
            f"processes ({OS_SHARE:.0%}, at least {OS_SHARE_MIN_GIB:g} GiB)"
        )
    if ram is None and available is None:
        assumed.append("no ram_gib or available_gib: the host side is not judged")
    swap = _gib(reader, table, "swap_gib", SIZE)
    if swap is None:
        swap = 0
        assumed.append("swap_gib not given: no swap")
    limit = _gib(reader, table, "cgroup_limit_gib", SIZE) or None
    used = _gib(reader, table, "cgroup_used_gib", SIZE)
    if used is not None and limit is None:
        raise reader.error("[host] cgroup_used_gib", "given without cgroup_limit_gib")
    if used is not None and limit is not None and used > limit:
        raise reader.error("[host] cgroup_used_gib", "is above cgroup_limit_gib")
    kernel = None
    if "kernel" in table:
        text = reader.text("[host] kernel", table["kernel"])
        kernel = driver.kernel_from_release(text)
        if kernel.version is None:
            raise reader.error(
                "[host] kernel",
                f"{shown(text)} is not a kernel release; accepted: e.g. 6.14.0-37-generic",
            )
    else:
        assumed.append(
            "kernel not given: unknown (with a runtime in compute-runtime #916's range, #916 "
            "is then not ruled out)"
        )
    p2p = table.get("p2p")
    if p2p is not None and not isinstance(p2p, bool):
        raise reader.error("[host] p2p", f"{shown(str(p2p))}: accepted: true, false")
    return {
        "ram": ram,
        "available": available,
        "swap": swap,
        "cgroup_limit": limit,
        "cgroup_used": used,
        "kernel": kernel,
        "p2p": p2p,
    }


def _gpu(reader: _Reader, n: int, entry: dict[str, Any], assumed: list[str]) -> GpuKind:
    where = f"[[gpu]] #{n}"
    known = None
    if "model" in entry:
        name = reader.text(f"{where} model", entry["model"])
        known = catalog.model_named(name)
    device_id = None
    if "pci_id" in entry:
        raw = entry["pci_id"]
        text = raw if isinstance(raw, str) else str(raw)
        match = re.fullmatch(r"(?:0x)?([0-9a-fA-F]{4})", text.strip())
        if isinstance(raw, bool) or not match:
            raise reader.error(
                f"{where} pci_id", f"{shown(text)} is not valid; accepted: a PCI id like '0xe223'"
            )
        device_id = int(match.group(1), 16)
        if known is not None and known.device_id != device_id:
            raise reader.error(
                f"{where} pci_id",
                f"0x{device_id:04x} is not the {known.name} (0x{known.device_id:04x})",
            )
        known = known or catalog.model_of(device_id)
    if "model" not in entry and device_id is None:
        raise reader.error(where, "needs model or pci_id")
    count = int(reader.number(f"{where} count", entry.get("count", 1), GPU_COUNT))
    if "count" not in entry:
        assumed.append(f"{where}: count not given, 1 assumed")
    memory: float | None
    if "memory_gib" in entry:
        memory = reader.number(f"{where} memory_gib", entry["memory_gib"], GPU_MEMORY)
    elif known is not None:
        memory = known.memory_gib
        assumed.append(f"{where}: {known.name} memory {memory:g} GiB {known.note}".rstrip())
    elif "model" not in entry:
        # A pci_id alone, as --write-host writes a GPU whose memory it could not read.
        memory = None
        assumed.append(
            f"{where}: 0x{device_id or 0:04x} is not a GPU doctor knows and memory_gib is not "
            "given: its memory is unknown (give memory_gib, or --device-memory-gib)"
        )
    else:
        given = entry.get("model", entry.get("pci_id"))
        raise reader.error(
            where,
            f"{shown(str(given))} is not a GPU doctor knows; give memory_gib (and pci_id), "
            f"or a model: {catalog.GPU_NAMES}",
        )
    if known is None:
        assumed.append(f"{where}: not a model doctor knows, so not taken for a Battlemage GPU")
    label = known.name if known else str(entry.get("model", f"0x{device_id or 0:04x}"))
    device = device_id or (known.device_id if known else 0)
    return GpuKind(label, device, count, None if memory is None else int(memory * GiB))


def _runtime(reader: _Reader, table: dict[str, Any]) -> driver.Runtime | None:
    if "compute_runtime" not in table:
        return None
    text = reader.text("[driver] compute_runtime", table["compute_runtime"])
    runtime = driver.runtime_from_version(text, "host file [driver]")
    if runtime is None:
        raise reader.error(
            "[driver] compute_runtime",
            f"{shown(text)} is not a compute-runtime version; accepted: year.week[.build"
            "[.hotfix]] as its releases are tagged (e.g. 26.14.37833.4), or 'build 37833'",
        )
    return runtime


def parse(data: dict[str, Any], path: str, image_flag: str | None = None) -> Described:
    """Check the parsed TOML of a host file and take what it says (``image_flag``: as
    :func:`load`'s ``image``)."""
    reader = _Reader(path)
    _check_keys(reader, data)
    assumed: list[str] = []
    host = _host(reader, data.get("host", {}), assumed)
    if "gpu" not in data:
        raise reader.error(
            "[[gpu]]", "is required: one table per GPU kind (gpu = [] for a machine without one)"
        )
    gpus = tuple(_gpu(reader, n + 1, entry, assumed) for n, entry in enumerate(data["gpu"]))
    if sum(g.count for g in gpus) > MAX_GPUS:
        raise reader.error("[[gpu]] count", f"more than {MAX_GPUS} GPUs in all")
    image_table = data.get("image", {})
    named = reader.text("[image] name", image_table["name"]) if "name" in image_table else None
    try:
        image_name = target.image_of(image_flag, named)
    except target.ImageError as exc:
        raise reader.error("[image] name", str(exc)) from None
    image = None if image_name is None else catalog.image_named(image_name)
    if image_name is not None and image is None:
        assumed.append(
            f"{catalog.not_in_table(image_name)}: its sym_int4, variables and "
            "compute-runtime are unknown"
        )
    layouts = None
    if "sym_int4_layouts" in image_table:
        layouts = int(
            reader.number("[image] sym_int4_layouts", image_table["sym_int4_layouts"], Bounds(1, 2))
        )
    runtime, inferred = target.runtime(image, _runtime(reader, data.get("driver", {})))
    if inferred:
        assumed.append(inferred)
    if runtime is None:
        assumed.append("compute-runtime not given: the host copy is taken as possible")
    env: dict[str, str] = {}
    for key, value in data.get("env", {}).items():
        if not VARIABLE_NAME.fullmatch(key):
            raise reader.error(f"[env] {shown(key)}", "is not a variable name")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise reader.error(f"[env] {key}", f"{shown(str(value))}: accepted: a string")
        env[key] = str(value)
    env = target.environment(image, env)
    plugin_table = data.get("plugin", {})
    installed = plugin_table.get("installed", False)
    if not isinstance(installed, bool):
        raise reader.error("[plugin] installed", f"{shown(str(installed))}: accepted: true, false")
    if not installed:
        assumed.append("judged without the plugin ([plugin] installed = true counts its fixes)")
    return Described(
        path=path,
        **host,
        gpus=gpus,
        runtime=runtime,
        image=image,
        int4_layouts=layouts,
        env=env,
        plugin=installed,
        assumed=tuple(assumed),
    )
