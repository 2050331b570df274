"""This host as the start-up model reads a machine: the files doctor reads (/proc, the
cgroup, sysfs, dpkg, the kernel release, all under the sysroot) and the plugin's switches.
doctor's ``facts.measure`` and the preflight both read the host here, and both turn what
was read into the start-up model's machine with :func:`machine`; files only, nothing is
loaded or started."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_xpu_memfix.core import config, files
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.intel import int4_layouts as layouts
from vllm_xpu_memfix.memory.checkpoint import Checkpoint
from vllm_xpu_memfix.memory.room import Room, host_room
from vllm_xpu_memfix.memory.snapshot import ProcReader, Snapshot
from vllm_xpu_memfix.startup import staging
from vllm_xpu_memfix.startup.sizing import Machine, ServeArgs, largest_staged_params
from vllm_xpu_memfix.startup.sizing import _layout as sizing_layout

OFFLOAD = "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT"
SYM_INT4 = "vllm.model_executor.layers.quantization.sym_int4"


@dataclass(frozen=True)
class HostFacts:
    """What the files say about this host and its Intel GPUs."""

    snap: Snapshot
    room: Room
    gpus: list[driver.Gpu]
    visible: list[driver.Gpu]
    runtime: driver.Runtime | None
    kernel: driver.Kernel | None


def read(sysroot: Path, environ: Mapping[str, str]) -> HostFacts:
    """Read this host (under ``sysroot``); ``environ`` narrows the visible GPUs."""
    gpus = driver.intel_gpus(sysroot)
    return HostFacts(
        snap=ProcReader(sysroot).take("self", pss=False),
        room=host_room(sysroot),
        gpus=gpus,
        visible=driver.visible_gpus(gpus, environ),
        runtime=driver.compute_runtime(sysroot),
        kernel=driver.kernel(sysroot),
    )


def device_bytes(gpus: list[driver.Gpu], override_gib: float | None) -> tuple[int | None, str]:
    """The smallest device's memory, and where it was read."""
    if override_gib is not None:
        return int(override_gib * GiB), "--device-memory-gib"
    sizes = [g.vram_bytes for g in gpus if g.vram_bytes]
    if sizes:
        return min(sizes), "sysfs physical_vram_size_bytes"
    known = [gib for g in gpus if (gib := catalog.memory_gib(g.device_id)) is not None]
    if known:
        return int(min(known) * GiB), "product table (assumed)"
    return None, "unknown: pass --device-memory-gib"


def legacy_load(environ: Mapping[str, str], sym_int4: str | None) -> tuple[bool, str]:
    """Whether sym_int4 will buffer each rank's whole 16-bit shard on the host, and why,
    from the installed module's source ``sym_int4`` (None: not installed).

    Only where that module reads ``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT``: the 0.14 and 0.21
    images' does; the 0.26 images' no longer does, though their Dockerfiles still set it
    (llm-scaler #672).
    """
    if environ.get(OFFLOAD) != "1":
        return False, f"{OFFLOAD} unset: one layer in flight"
    if sym_int4 is None:
        return False, f"{OFFLOAD}=1, but no sym_int4 is installed here to read it"
    if OFFLOAD not in sym_int4:
        return False, f"{OFFLOAD}=1 is stale: this sym_int4 never reads it (llm-scaler #672)"
    return True, f"{OFFLOAD}=1: sym_int4's legacy load holds the whole 16-bit shard"


def int4_layouts(quantization: str | None, sym_int4: str | None) -> tuple[int, str]:
    """Device layouts per sym_int4 weight of the installed module (source ``sym_int4``),
    and where that was read: two in 0.21.0-b1's (registered inline), one otherwise; told
    from its structure (intel/int4_layouts). ``(1, "")`` for any other quantization."""
    if (quantization or "").lower() != "sym_int4":
        return 1, ""
    if sym_int4 is None:
        return 1, "assumed one layout: no sym_int4 is installed here"
    recognised = layouts.recognise(layouts.shape_of_source(sym_int4))
    if recognised.layout is layouts.INLINE_REGISTRATION:
        return 2, f"the installed sym_int4 ({recognised.layout.key}): two layouts"
    return 1, f"the installed sym_int4 ({recognised.why}): one layout"


def kv_headroom_on(settings: Settings | None, plugin: bool, visible: list[driver.Gpu]) -> bool:
    """Whether kv_headroom takes its reserve: ``on``, or ``auto`` with Intel GPUs visible."""
    if not plugin or settings is None or not settings.requested(config.KV_HEADROOM):
        return False
    return settings.mode(config.KV_HEADROOM) is config.Mode.ON or bool(visible)


def load_slots(
    settings: Settings, args: ServeArgs, holds_shard: bool, room: Room, ckpt: Checkpoint | None
) -> int | None:
    """How many ranks the load lock lets stage at once; None where it stays off. Sized
    from the room as the lock sizes it (``staging.slots_for_room``), from the same
    staging per rank."""
    if not settings.requested(config.LOAD_LOCK):
        return None
    if args.max_parallel_loading_workers:
        return args.max_parallel_loading_workers
    if settings.mode(config.LOAD_LOCK) is config.Mode.ON:
        return settings.load_slots or 1
    if not holds_shard:
        return None
    if settings.load_slots is not None:
        return settings.load_slots
    tp = args.tensor_parallel_size
    shard = ckpt.total_bytes / tp if ckpt else 0.0
    unit = largest_staged_params(ckpt)[0] / tp if ckpt else 0.0
    slots = staging.slots_for_room(room, staging.per_rank(unit, shard_bytes=shard), tp).slots
    return slots if slots < tp else None


def used_gpus(facts: HostFacts, args: ServeArgs) -> list[driver.Gpu]:
    """The GPUs this node's ranks will take (TP x PP of each engine here: startup.layout):
    the first visible ones, else every Intel GPU."""
    here = sizing_layout(args).ranks_here
    return facts.visible[:here] or facts.gpus


def machine(
    facts: HostFacts,
    settings: Settings | None,
    environ: Mapping[str, str],
    *,
    device_bytes: int | None,
    load_slots: int | None,
    legacy_load: tuple[bool, str] = (False, ""),
    plugin: bool = True,
    p2p: bool | None = None,
    int4_layouts: int = 1,
) -> Machine:
    """What was read, as the start-up model reads a machine: the one mapping that doctor
    (this host or a described one, ``facts.Measurement.machine``) and the preflight (this
    host) both use. ``environ`` is what the serving processes start with, the driver
    guard's keys in it; ``device_bytes`` and ``load_slots`` as sized by
    :func:`device_bytes` and :func:`load_slots`. A room that could not be read, here or in
    a host file, stays unknown (None): the host side is then not judged."""
    room = facts.room.bytes
    return Machine(
        gpus_visible=len(facts.visible),
        battlemage_visible=sum(g.is_battlemage for g in facts.visible),
        device_bytes=float(device_bytes) if device_bytes else None,
        runtime=facts.runtime,
        kernel=facts.kernel,
        environ=dict(environ),
        room=None if room is None else float(room),
        swap=float(facts.snap.swap_free or 0),
        p2p=p2p,
        plugin=plugin,
        kv_headroom=kv_headroom_on(settings, plugin, facts.visible),
        kv_headroom_slack=float(settings.kv_headroom_slack_mib * 2**20)
        if settings
        else Machine.kv_headroom_slack,
        load_slots=load_slots,
        legacy_load=legacy_load,
        int4_layouts=int4_layouts,
    )


def installed_sym_int4() -> str | None:
    """The source of the sym_int4 module of the vLLM this process runs (Intel's images
    ship one), found without importing it; None where there is none."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(SYM_INT4)
    except ImportError:
        return None
    if spec is None or not spec.origin:
        return None
    return files.read_text(spec.origin, files.LIST_CAP)
