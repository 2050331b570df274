"""A described machine as doctor's facts, and this machine as a host file.

:func:`measurement` turns a :class:`hostfile.Described` into the same
:class:`facts.Measurement` that ``facts.measure`` reads from this host, so the rest of
doctor cannot tell them apart. :func:`write_host` writes this host's file so that
``--host`` on it gives the same verdict and figures as plain ``doctor``.

"Would the driver guard act" is asked of the guard itself (``driver_env.decide_for``),
with the described GPUs, runtime and kernel in place of what it reads on a real host.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_xpu_memfix.cli.doctor import facts, hostfile
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver
from vllm_xpu_memfix.intel import driver_facts as dfacts
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.memory.snapshot import CgroupMemory, Snapshot
from vllm_xpu_memfix.startup import host
from vllm_xpu_memfix.startup.sizing import ServeArgs

NOT_INSTALLED = "the plugin is not installed on the described machine ([plugin] installed = true)"
# Plugin variables that name a path on the machine that wrote the file: never written.
_LOCAL_PATHS = {v.name for v in config.PARAMETERS if "directory" in v.accepted}
_PREFIX = config.PREFIX


def _gpus(described: hostfile.Described) -> list[driver.Gpu]:
    gpus: list[driver.Gpu] = []
    for kind in described.gpus:
        for _ in range(kind.count):
            n = len(gpus)
            gpus.append(driver.Gpu(f"card{n}", kind.device_id, f"gpu{n}", kind.memory_bytes))
    return gpus


def _guard(described: hostfile.Described, visible: list[driver.Gpu]) -> driver_env.Decision:
    env = described.env
    if not described.plugin:
        user_set = {k: env[k] for k in driver_env.GUARD_ENV if k in env}
        return driver_env.Decision(False, NOT_INSTALLED, user_set=user_set)
    host = driver_env.Host.of(
        visible,
        lambda: described.runtime,
        lambda: described.kernel,
        f"{described.path} ([[gpu]])",
    )
    return driver_env.decide_for(config.load(env), env, lambda: host)


def _legacy(described: hostfile.Described) -> tuple[bool, str]:
    offload = described.env.get(facts.OFFLOAD) == "1"
    image = described.image
    if not offload:
        return False, f"{facts.OFFLOAD} unset: one layer in flight"
    if image is None:
        return True, (
            f"{facts.OFFLOAD}=1 and no known image: taken as the legacy load (the whole "
            "16-bit shard on the host)"
        )
    if image.load != "legacy":
        return False, f"{facts.OFFLOAD}=1 is stale: image {image.tag}'s sym_int4 never reads it"
    return True, f"{facts.OFFLOAD}=1: image {image.tag}'s sym_int4 holds the whole 16-bit shard"


def measurement(described: hostfile.Described, args: ServeArgs) -> facts.Measurement:
    """The facts of the described machine, as ``facts.measure`` gives this one's."""
    env = described.env
    settings = config.load(env if described.plugin else {_PREFIX: "0"})
    gpus = _gpus(described)
    visible = driver.visible_gpus(gpus, env)
    guard = _guard(described, visible)
    used = visible[: args.tensor_parallel_size] or gpus
    device = min((g.vram_bytes for g in used if g.vram_bytes), default=None)
    if args.device_memory_gib is not None:
        device = int(args.device_memory_gib * GiB)
    limit = described.cgroup_limit
    cgroup = CgroupMemory(described.cgroup_used or 0, limit) if limit else CgroupMemory()
    room = Room(described.available, cgroup, described.path)
    snap = Snapshot(
        ts=0.0,
        pid=0,
        mem_total=described.ram,
        mem_available=described.available,
        swap_total=described.swap,
        swap_free=described.swap,
        cgroup_current=described.cgroup_used if limit else None,
        cgroup_max=limit,
    )
    legacy = _legacy(described)
    ckpt, label = facts.read_model(args)
    slots = host.load_slots(settings, args, legacy[0], room, ckpt) if described.plugin else None
    image = described.image
    layouts = described.int4_layouts or (2 if image and image.duplicate_layout else 1)
    layouts_from = (
        "[image] sym_int4_layouts"
        if described.int4_layouts
        else f"image {image.tag}: {image.int4_layout}"
        if image
        else "assumed one layout (no image given)"
    )
    return facts.Measurement(
        snap=snap,
        gpus=gpus,
        visible=visible,
        runtime=described.runtime,
        level_zero_loader=None,
        guard=guard,
        device_bytes=device,
        device_source="--device-memory-gib" if args.device_memory_gib else described.path,
        ckpt=ckpt,
        model_label=label,
        legacy=legacy,
        room=room,
        load_slots=slots,
        kernel=described.kernel,
        environ=dict(env),
        plugin=described.plugin,
        settings=settings,
        image=image,
        int4_layouts=layouts,
        int4_layouts_from=layouts_from,
        described=described.path,
        assumed=described.assumed,
        p2p=described.p2p,
    )


# --- this machine as a host file -------------------------------------------------------


def _env_to_write(environ: Mapping[str, str]) -> dict[str, str]:
    names = set(facts.RELEVANT_ENV) | set(dfacts.VARIABLE_NAMES)
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k in names or k.startswith(_PREFIX)) and k not in _LOCAL_PATHS
    }


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def write_host(measured: facts.Measurement) -> str:
    """This machine as a host file: what plain ``doctor`` reads here."""
    snap, room = measured.snap, measured.room
    lines = ["# This machine as vllm-xpu-memfix doctor read it (doctor --write-host)."]
    if not measured.gpus:
        lines.append("gpu = []  # no Intel GPU found")
    lines += ["", "[host]"]
    if snap.mem_total is not None:
        lines.append(f"ram_gib = {snap.mem_total / GiB!r}")
    if room.mem_available is not None:
        lines.append(f"available_gib = {room.mem_available / GiB!r}")
    lines.append(f"swap_gib = {(snap.swap_free or 0) / GiB!r}  # free swap")
    cgroup = room.cgroup
    if cgroup.limit is not None and cgroup.usage is not None and not cgroup.problem:
        lines.append(f"cgroup_limit_gib = {cgroup.limit / GiB!r}")
        lines.append(f"cgroup_used_gib = {cgroup.usage / GiB!r}")
    if measured.kernel is not None and measured.kernel.release:
        lines.append(f"kernel = {_toml_string(measured.kernel.release)}")
    if measured.p2p is not None:
        lines.append(f"p2p = {'true' if measured.p2p else 'false'}")
    kinds: dict[tuple[int, int | None], int] = {}
    for gpu in measured.gpus:
        memory = gpu.vram_bytes or measured.device_bytes
        kinds[(gpu.device_id, memory)] = kinds.get((gpu.device_id, memory), 0) + 1
    for (device_id, memory), count in kinds.items():
        lines += ["", "[[gpu]]", f'pci_id = "0x{device_id:04x}"', f"count = {count}"]
        if memory:
            lines.append(f"memory_gib = {memory / GiB!r}")
    if measured.runtime is not None:
        lines += ["", "[driver]", f"compute_runtime = {_toml_string(measured.runtime.version)}"]
    if measured.int4_layouts_from.startswith("the installed sym_int4"):
        lines += ["", "[image]", f"sym_int4_layouts = {measured.int4_layouts}"]
    env = _env_to_write(measured.environ)
    if env:
        lines += ["", "[env]", *(f"{k} = {_toml_string(v)}" for k, v in env.items())]
    lines += ["", "[plugin]", f"installed = {'true' if measured.plugin else 'false'}", ""]
    return "\n".join(lines)
