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

from vllm_xpu_memfix.cli.doctor import facts, hostfile, target
from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.numbers import Bounds
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
_LOCAL_PATHS = {v.name for v in config.PARAMETERS if v.path}
_PREFIX = config.PREFIX


def _gpus(described: hostfile.Described) -> list[driver.Gpu]:
    gpus: list[driver.Gpu] = []
    for kind in described.gpus:
        for _ in range(kind.count):
            n = len(gpus)
            gpus.append(driver.Gpu(f"card{n}", kind.device_id, f"gpu{n}", kind.memory_bytes))
    return gpus


def _settings(described: hostfile.Described) -> config.Settings:
    """The plugin's settings on the described machine, from its ``[env]``: judged as that
    machine's (its paths are not looked up here); a bad value names the file and ``[env]``."""
    if not described.plugin:
        return config.load({_PREFIX: "0"})
    try:
        return config.load(described.env, this_machine=False)
    except numbers.ConfigError as exc:
        raise hostfile.HostFileError(f"{described.path}: [env] {exc}") from None


def _guard(
    described: hostfile.Described, visible: list[driver.Gpu], settings: config.Settings
) -> driver_env.Decision:
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
    return driver_env.decide_for(settings, env, lambda: host)


def measurement(described: hostfile.Described, args: ServeArgs) -> facts.Measurement:
    """The facts of the described machine, as ``facts.measure`` gives this one's."""
    env = described.env
    settings = _settings(described)
    gpus = _gpus(described)
    visible = driver.visible_gpus(gpus, env)
    guard = _guard(described, visible, settings)
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
    legacy = target.legacy(env, described.image)
    ckpt, label = facts.read_model(args)
    slots = host.load_slots(settings, args, legacy[0], room, ckpt) if described.plugin else None
    image = described.image
    layouts, layouts_from = (
        (described.int4_layouts, "[image] sym_int4_layouts")
        if described.int4_layouts
        else target.layouts(image)
        if image
        else (1, "assumed one layout (no image given)")
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
    """The variables that change the verdict, by names a host file takes; never a path of
    this machine, nothing unrelated."""
    names = set(facts.RELEVANT_ENV) | set(dfacts.VARIABLE_NAMES)
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k in names or k.startswith(_PREFIX))
        and k not in _LOCAL_PATHS
        and hostfile.VARIABLE_NAME.fullmatch(k)
    }


def _toml_string(value: str) -> str:
    """A TOML basic string that reads back as ``value``: backslash and quote escaped, and
    every character that is not printable as its ``\\uXXXX`` or ``\\UXXXXXXXX`` escape. TOML
    holds only Unicode scalar values, so each lone surrogate (an undecodable byte of a
    non-UTF-8 environment value, as Python holds it) is written as U+FFFD."""
    out = []
    for c in value.replace("\\", "\\\\").replace('"', '\\"'):
        if c.isprintable():
            out.append(c)
        elif 0xD800 <= ord(c) <= 0xDFFF:
            out.append("\\ufffd")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def _gib_line(key: str, value: int, bounds: Bounds, note: str = "") -> str:
    """``key = GiB`` exactly (the repr of bytes / 2**30 reads back to the same bytes), or a
    comment where the figure read here is outside what a host file takes."""
    gib = value / GiB
    if bounds.value_of(repr(gib)) is None:
        return f"# {key}: {gib!r} read here is not {bounds.accepted}; left out"
    return f"{key} = {gib!r}{note}"


def write_host(measured: facts.Measurement) -> str:
    """This machine as a host file: what plain ``doctor`` reads here. Every value it
    writes reads back (``hostfile.parse``) to the value read here; one that could not is
    left out with a comment saying why."""
    snap, room = measured.snap, measured.room
    lines = ["# This machine as vllm-xpu-memfix doctor read it (doctor --write-host)."]
    if not measured.gpus:
        lines.append("gpu = []  # no Intel GPU found")
    lines += ["", "[host]"]
    ram, available = snap.mem_total, room.mem_available
    if ram is not None and available is not None and available > ram:
        lines.append(f"# MemAvailable {available} above MemTotal {ram}: both left out")
        ram = available = None
    if room.problem:  # unknown stays unknown: --host judges no host without RAM figures
        lines.append(
            f"# room unreadable here ({numbers.printable(room.problem, 120)}): RAM left out"
        )
        ram = available = None
    if ram is not None:
        lines.append(_gib_line("ram_gib", ram, hostfile.RAM))
    if available is not None:
        lines.append(_gib_line("available_gib", available, hostfile.SIZE))
    lines.append(_gib_line("swap_gib", snap.swap_free or 0, hostfile.SIZE, "  # free swap"))
    cgroup = room.cgroup
    limit, used = cgroup.limit, cgroup.usage
    if limit is not None and used is not None and not cgroup.problem:
        limit_line = _gib_line("cgroup_limit_gib", limit, hostfile.SIZE)
        used_line = _gib_line("cgroup_used_gib", used, hostfile.SIZE)
        if used > limit or limit == 0 or limit_line.startswith("#"):
            lines.append(f"# cgroup used {used} of limit {limit}: not a figure a host file takes")
        else:
            lines += [limit_line, used_line]
    if measured.kernel is not None and measured.kernel.version is not None:
        lines.append(f"kernel = {_toml_string(measured.kernel.release or '')}")
    if measured.p2p is not None:
        lines.append(f"p2p = {'true' if measured.p2p else 'false'}")
    kinds: dict[tuple[int, int | None], int] = {}
    for gpu in measured.gpus:
        memory = gpu.vram_bytes or measured.device_bytes
        kinds[(gpu.device_id, memory)] = kinds.get((gpu.device_id, memory), 0) + 1
    for (device_id, memory), count in kinds.items():
        lines += ["", "[[gpu]]", f'pci_id = "0x{device_id:04x}"', f"count = {count}"]
        if memory:
            lines.append(_gib_line("memory_gib", memory, hostfile.GPU_MEMORY))
    if measured.runtime is not None:
        lines += ["", "[driver]", f"compute_runtime = {_toml_string(measured.runtime.version)}"]
    if measured.int4_layouts_from.startswith("the installed sym_int4"):
        lines += ["", "[image]", f"sym_int4_layouts = {measured.int4_layouts}"]
    env = _env_to_write(measured.environ)
    if env:
        lines += ["", "[env]"]
        for k, v in env.items():
            if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
                lines.append(f"# {k}: not UTF-8 here; each undecodable byte written as U+FFFD")
            lines.append(f"{k} = {_toml_string(v)}")
    lines += ["", "[plugin]", f"installed = {'true' if measured.plugin else 'false'}", ""]
    return "\n".join(lines)
