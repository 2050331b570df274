"""What doctor reads: the serve command's arguments, this host, its GPUs and driver, and
the checkpoint. Files only; nothing is loaded or started."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_xpu_memfix.cli import compat
from vllm_xpu_memfix.cli.doctor import deadline, target
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.memory import hub, hub_cache
from vllm_xpu_memfix.memory.checkpoint import (
    TORCH_DTYPES,
    Checkpoint,
    CheckpointError,
    SizeUnknown,
    checkpoint_from_params,
    read_checkpoint,
)
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.memory.snapshot import Snapshot
from vllm_xpu_memfix.startup import host
from vllm_xpu_memfix.startup.host import OFFLOAD
from vllm_xpu_memfix.startup.sizing import Machine, ServeArgs

# The variables that change how much host memory a start takes, shown when set.
RELEVANT_ENV = (
    "NEOReadDebugKeys",
    "EnableDeferBacking",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
    OFFLOAD,
)


@dataclass(frozen=True)
class Measurement:
    """What the files say: this host, its GPUs and driver, and the checkpoint."""

    snap: Snapshot
    gpus: list[driver.Gpu]
    visible: list[driver.Gpu]
    runtime: driver.Runtime | None
    level_zero_loader: str | None
    guard: driver_env.Decision
    device_bytes: int | None
    device_source: str
    ckpt: Checkpoint | None
    model_label: str
    legacy: tuple[bool, str]
    room: Room
    load_slots: int | None
    kernel: driver.Kernel | None = None
    # What the serving processes run with: this process's environment, or a host file's.
    environ: Mapping[str, str] = field(default_factory=dict)
    # Whether the plugin's fixes count (always here; a host file's [plugin] installed).
    plugin: bool = True
    settings: Settings | None = None
    image: catalog.Image | None = None
    int4_layouts: int = 1  # device layouts per sym_int4 weight
    int4_layouts_from: str = "assumed: one layout"
    # Where the facts come from: None for this machine, else the host file.
    described: str | None = None
    assumed: tuple[str, ...] = ()
    p2p: bool | None = None  # peer access between the GPUs; None: not known

    @property
    def visible_battlemage(self) -> int:
        return sum(g.is_battlemage for g in self.visible)

    def effective_env(self) -> dict[str, str]:
        """The serving processes' environment, with what the driver guard sets."""
        env = dict(self.environ)
        driver_env.apply(self.guard, env)
        return env

    def host_facts(self) -> host.HostFacts:
        """The host part of these facts, as ``startup.host`` reads this host."""
        return host.HostFacts(
            snap=self.snap,
            room=self.room,
            gpus=self.gpus,
            visible=self.visible,
            runtime=self.runtime,
            kernel=self.kernel,
        )

    def machine(self) -> Machine:
        """This measurement as the start-up model reads a machine (``host.machine``), with
        what its image runs."""
        found = host.machine(
            self.host_facts(),
            self.settings,
            self.effective_env(),
            device_bytes=self.device_bytes,
            load_slots=self.load_slots,
            legacy_load=self.legacy,
            plugin=self.plugin,
            p2p=self.p2p,
            int4_layouts=self.int4_layouts,
        )
        return replace(found, ipex_gptq_moe=bool(self.image and self.image.ipex_gptq_moe))


def _params_dtype(args: ServeArgs) -> str:
    """The checkpoint dtype assumed for a bare parameter count: --dtype's, else BF16."""
    return TORCH_DTYPES.get((args.dtype or "").removeprefix("torch."), "BF16")


def read_model(args: ServeArgs) -> tuple[Checkpoint | None, str]:
    """The checkpoint behind ``args.model``: a local path; else a Hugging Face id from the
    local cache, else from the Hub's metadata (``memory.hub``); else ``--params``. Where
    none of them tells, the format and size are unknown and doctor says so (exit 2)."""
    if args.model is None:
        if args.params is None:
            return None, ""
        return checkpoint_from_params(args.params, _params_dtype(args)), "--params"
    path = Path(args.model)
    if path.exists():
        return read_checkpoint(path, args.params), str(path)
    reference = hub.hub_reference(args.model)
    if reference is None:
        # A path on another machine (a pasted serve line, a --host machine).
        here = "not on this machine"
        return _not_at_hand(args, f"it is {here}"), f"{args.model} ({here})"
    in_repo_gguf = reference[1:] != (None, None)
    cached, held, cache_note = (None, None, "") if in_repo_gguf else _from_cache(args.model)
    if held is not None and held[0].complete:
        return held
    notes: list[str] = []  # a server that ignored Range
    try:
        ckpt = hub.read(args.model, deadline.left(deadline.DEFAULT_S), notes)
        return ckpt, f"{args.model} (Hugging Face Hub: metadata{''.join('; ' + n for n in notes)})"
    except hub.LibraryMissing as exc:
        why = cache_note.removesuffix("; ") or str(exc)
    except hub.HubUnavailable as exc:
        why = f"{cache_note}{exc}"
    if held is not None:
        return held
    if cached is not None and args.params is not None:
        return read_checkpoint(cached.snapshot, args.params, name=args.model), cached.label
    return _not_at_hand(args, why), f"{args.model} (neither at hand nor read from the Hub)"


def _from_cache(
    model: str,
) -> tuple[hub_cache.CachedModel | None, tuple[Checkpoint, str] | None, str]:
    """The id in the local Hugging Face cache: the snapshot, what it holds of the weights'
    headers and how to name it (None where it holds no weights), and what is missing."""
    try:
        cached = hub_cache.find_cached(model)
    except hub_cache.HubCacheError as exc:
        return None, None, f"{exc}; "
    try:
        return cached, (read_checkpoint(cached.snapshot, None, name=model), cached.label), ""
    except SizeUnknown:
        return cached, None, "the Hugging Face cache lacks its weights' headers; "


def _not_at_hand(args: ServeArgs, why: str) -> Checkpoint:
    """Only ``--params`` can size a checkpoint that is not at hand; a GGUF file not even that
    (its bytes per weight are in its header)."""
    assert args.model is not None
    if args.params is not None and not hub.is_gguf(args.model):
        return checkpoint_from_params(args.params, _params_dtype(args))
    if hub.is_gguf(args.model):
        raise CheckpointError(
            f"{args.model}: a GGUF file whose quantization type and size are unknown ({why}); "
            "pass a local path"
        )
    raise CheckpointError(
        f"{args.model}: its format and size are unknown ({why}); pass a local path, "
        "or the model's size with --params (e.g. --params 8B)"
    )


def measure(
    settings: Settings,
    args: ServeArgs,
    environ: Mapping[str, str],
    image: catalog.Image | None = None,
) -> Measurement:
    """Read every file doctor needs; nothing is loaded or started. ``image``: the image
    this machine will serve from (``--image``), applied as a host file's (``target``)."""
    environ = target.environment(image, environ)
    read = host.read(settings.sysroot, environ)
    guard = driver_env.decide(settings, environ)
    device_bytes, device_source = host.device_bytes(
        host.used_gpus(read, args), args.device_memory_gib
    )
    root = compat.installed_vllm_root()
    sym_int4 = compat.module_source(root, host.SYM_INT4) if root is not None else None
    if image is None:
        legacy = host.legacy_load(environ, sym_int4)
        layouts = host.int4_layouts(args.quantization, sym_int4)
    else:
        legacy, layouts = target.legacy(environ, image), target.layouts(image)
    ckpt, model_label = read_model(args)
    return Measurement(
        snap=read.snap,
        gpus=read.gpus,
        visible=read.visible,
        runtime=target.runtime(image, read.runtime)[0],
        level_zero_loader=driver.level_zero_loader(settings.sysroot),
        guard=guard,
        device_bytes=device_bytes,
        device_source=device_source,
        ckpt=ckpt,
        model_label=model_label,
        legacy=legacy,
        room=read.room,
        load_slots=host.load_slots(settings, args, legacy[0], read.room, ckpt),
        kernel=read.kernel,
        environ=dict(environ),
        plugin=True,
        settings=settings,
        int4_layouts=layouts[0],
        int4_layouts_from=layouts[1],
        image=image,
    )
