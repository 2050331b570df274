"""Load lock: at most N ranks of a host load their weights at once.

Problem
    Intel's ``sym_int4`` in its legacy load (``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1``,
    which the 0.14 and 0.21 images set) allocates every quantized layer's BF16 weight
    on the CPU, loads the whole checkpoint shard into it, and only then quantizes layer
    by layer (llm-scaler ``vllm_for_multi_arc.patch``, tags ``vllm-0.14.0-b8.3.2`` and
    ``vllm-0.21.0-b2``). Every rank does it at the same moment, so the host holds TP
    BF16 shards at once: about 54 GB for a 27B model at TP 4, 244 GB for a 122B MoE
    model. vLLM has the flag meant for this, ``--max-parallel-loading-workers`` ("to
    avoid RAM OOM when using tensor parallel and large models"), but since the V1 engine
    it only warns that it "will be ignored" (vLLM PR #1395 implemented it for the old Ray
    executor). A host with room for every rank's shard has nothing to save, and
    serialising there only costs start-up time (docs/fixes.md, load_lock).
Mechanism
    Right after the loader builds the model (``initialize_model``, which allocates
    without touching pages), decide whether this rank stages its whole shard
    on the host: the model's sym_int4 layers hold real BF16 weights on the CPU before a
    single weight was read. If so, the slots are as many ranks' staging as the host's
    room holds (``memory.room``: MemAvailable, or the container's cgroup limit less its
    usage where smaller), 1 to the ranks on the host; the first rank of the engine to
    decide writes the number into the lock directory (``host_lock.agree``) and the
    others read it, so all queue on one semaphore. All ranks fitting means no lock.
    ``--max-parallel-loading-workers N`` or ``VLLM_XPU_MEMFIX_LOAD_SLOTS`` set the
    number instead. The rank then takes one of N slots of a host-wide semaphore of file
    locks (``host_lock``) before the weights are read. The slot is given back right
    after ``process_weights_after_loading``, once this rank's staging is gone:
    host_release's step (attributes, unused vocabulary copies, ``gc.collect()`` and
    ``malloc_trim``) runs inside the locked section, or just gc and the trim when
    host_release is off; at the end of ``Worker.load_model`` if
    loading failed. No collective runs between those points: the section is the
    loader's construction, weight reading and per-layer processing of one rank
    (docs/design/load-lock.md shows it per vLLM version). A rank that waited
    ``VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S`` loads unlocked with a WARNING naming the holder;
    an unusable lock directory (or an entry in it that is not a regular file) gives an
    ERROR and an unlocked load. Any other failure on the plugin's side is logged in one
    line and never reaches vLLM; vLLM's own exceptions pass through unchanged.
Targets
    ``vllm.model_executor.model_loader.base_loader:initialize_model`` and
    ``vllm.model_executor.model_loader.base_loader:process_weights_after_loading``
    (module globals that ``BaseModelLoader.load_model`` calls, vLLM 0.26 to 0.34),
    ``vllm.v1.worker.gpu_worker:Worker.load_model`` (XPUWorker and CPUWorker inherit it).
Switch
    ``VLLM_XPU_MEMFIX_LOAD_LOCK`` (auto: on where a rank stages its whole shard on the
    host and the room does not hold every rank's, or ``--max-parallel-loading-workers``
    is given; on: always; off: never); ``VLLM_XPU_MEMFIX_LOAD_SLOTS`` (auto: from the
    room), ``VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S``, ``VLLM_XPU_MEMFIX_LOAD_SCOPE`` (host |
    instance), ``VLLM_XPU_MEMFIX_LOCK_DIR``; ``VLLM_XPU_MEMFIX_SYSROOT`` roots the room's
    reads.
Upstream
    vLLM: honour ``max_parallel_loading_workers`` in the multiprocessing executor with a
    node-local lock around the same section; llm-scaler: stream the legacy path, or
    quantize each layer as it completes; see docs/design/load-lock.md.
Remove when
    vLLM honours ``max_parallel_loading_workers`` again (``base_loader`` or the worker
    reads it): docs/upstream/patches/0001 (``limit_parallel_loading`` in ``base_loader``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.causes import QUANT_STAGING
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import get_logger, see
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.vllm_code.overrides import with_platform_overrides

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix.core.host_lock import Holding, HostSemaphore
    from vllm_xpu_memfix.memory.room import Room

logger = get_logger("load_lock")

FIX = config.LOAD_LOCK
REMOVE_WHEN = RemoveWhen(
    "vLLM limits how many ranks load at once itself (upstream patch 0001)",
    "vllm.model_executor.model_loader.base_loader",
    ("max_parallel_loading_workers", "limit_parallel_loading"),
)
SYM_INT4 = "vllm.model_executor.layers.quantization.sym_int4"
_LOADER = "vllm.model_executor.model_loader.base_loader"
# Load formats whose loaders run collectives (0.32 weight_utils: fastsafetensors on the
# world group, instanttensor on the world device group; 0.34 runai_streamer_loader).
COLLECTIVE_LOAD_FORMATS = ("runai_streamer", "fastsafetensors", "instanttensor")
ONLINE_QUANTIZATION = "vllm.model_executor.layers.quantization.online"
ROOM_SIZED = "load lock sized from the room"


class HostStaged(NamedTuple):
    bytes: int
    layers: int
    largest_params: int  # of one such layer: the unit converted at once
    other_bytes: int  # every other weight already real on the CPU


def host_staged_bytes(model: Any) -> HostStaged:
    """Bytes and count of sym_int4 layers whose BF16 weight is real and on the CPU, and
    the largest one's parameters.

    Called before any weight is read: streaming and layerwise loads keep these weights
    on the meta device until their layer's elements arrive, so only the legacy load,
    which buffers the whole shard on the host, has any.
    """
    total = layers = largest = other = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        int4 = type(method).__module__ == SYM_INT4 and weight is not None
        for param in module.parameters(recurse=False):
            if param.is_meta or param.device.type != "cpu":
                continue
            if int4 and param is weight:
                total += weight.numel() * weight.element_size()
                layers += 1
                largest = max(largest, weight.numel())
            else:
                other += param.numel() * param.element_size()
    return HostStaged(total, layers, largest, other)


def collective_in_section(model: Any, vllm_config: Any) -> str | None:
    """Why this load runs a collective between construction and processing, if it does.

    The default loader, the generic processing loop and sym_int4 run none (vLLM 0.26 to
    0.34, docs/design/load-lock.md); these features do, and a rank queued for a slot would then
    hold its peers inside that collective.
    """
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", ""))
    if load_format.startswith(COLLECTIVE_LOAD_FORMATS):
        return f"--load-format {load_format} runs a collective while loading"
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        return "MLA with decode context parallel all-gathers while processing weights"
    if getattr(parallel, "enable_expert_parallel", False):
        return "expert-parallel MoE builds its all-to-all handles while processing weights"
    online = next(
        (
            type(method).__name__
            for module in model.modules()
            if type(method := getattr(module, "quant_method", None)).__module__.startswith(
                ONLINE_QUANTIZATION
            )
        ),
        None,
    )
    if online is not None and getattr(parallel, "tensor_parallel_size", 1) > 1:
        return f"vLLM's online quantization ({online}) all-reduces weight scales while loading"
    return None


def ranks_on_host(vllm_config: Any) -> int:
    parallel = vllm_config.parallel_config
    return max(1, parallel.world_size // max(1, getattr(parallel, "nnodes", 1)))


def agreed_room_slots(settings: Settings, staging: float, ranks: int) -> tuple[int, str]:
    """:func:`staging.slots_for_room` as the engine's first rank to get here decided it: the ranks
    may see different rooms, but must queue on one semaphore. Logs the decision, as a
    WARNING where it was cramped, and the deciding rank's room at DEBUG."""
    from vllm_xpu_memfix.core.host_lock import agree
    from vllm_xpu_memfix.core.process import instance_key, instance_token
    from vllm_xpu_memfix.memory.room import host_room
    from vllm_xpu_memfix.startup import staging as host_staging

    rooms: list[Room] = []

    def decide_here() -> str:
        rooms.append(host_room(settings.sysroot))
        found = host_staging.slots_for_room(rooms[0], staging, ranks)
        return f"{found.slots} {int(found.cramped)} {found.why}"

    name = f"load-slots-{instance_key()}"
    value, mine = agree(settings.lock_dir, name, instance_token(), decide_here)
    count, cramped, why = value.split(" ", 2)
    who = "this rank decided" if mine else "as the engine's first rank decided"
    line = f"{ROOM_SIZED} ({who}): {why}"
    if rooms and rooms[0].bytes is None:  # names the file that could not be read
        logger.warning("vllm-xpu-memfix: load lock: %s", rooms[0].describe())
    if cramped == "1":
        logger.warning("vllm-xpu-memfix: %s. See %s", line, see(QUANT_STAGING))
    else:
        logger.info("vllm-xpu-memfix: %s", line)
    if rooms and rooms[0].bytes is not None:
        logger.debug(
            "vllm-xpu-memfix: load lock: %s; the loading ranks may plan on %.0f%% of the room",
            rooms[0].describe(),
            100 * host_staging.ROOM_SHARE,
        )
    return int(count), line


def decide(settings: Settings, model: Any, vllm_config: Any) -> tuple[int | None, str]:
    """How many slots to queue on (None: no lock), and why."""
    collective = collective_in_section(model, vllm_config)
    if collective is not None:
        return None, f"{collective}, so a rank must not wait for a slot there"
    parallel = getattr(vllm_config, "parallel_config", None)
    flag = getattr(parallel, "max_parallel_loading_workers", None)
    if flag:
        return int(flag), f"--max-parallel-loading-workers {flag}"
    if settings.mode(FIX) is Mode.ON:
        return settings.load_slots or 1, f"{FIX.env}=on"
    staged = host_staged_bytes(model)
    if not staged.bytes:
        return None, "no layer buffers its weights on the host before loading"
    shard = (
        f"this rank stages its whole BF16 shard on the host ({staged.bytes / MiB:,.1f} MiB in "
        f"{staged.layers} sym_int4 layers allocated on the CPU before loading)"
    )
    if settings.load_slots is not None:
        return settings.load_slots, f"{shard}; {config.variable_for('load_slots').name}"
    from vllm.platforms import current_platform

    from vllm_xpu_memfix.intel.catalog import ONE_LAYOUT
    from vllm_xpu_memfix.startup import staging

    ranks = ranks_on_host(vllm_config)
    per_rank = staging.per_rank(staged.largest_params, shard_bytes=staged.bytes)
    if current_platform.is_cpu():
        # The device is the host here: the converted and the other weights stay beside it.
        per_rank += staged.bytes / 2 * ONE_LAYOUT + staged.other_bytes
    slots, why = agreed_room_slots(settings, per_rank, ranks)
    return (slots if slots < ranks else None), why


def distributed_timeout_s(vllm_config: Any) -> float:
    """The process-group time-out of the ranks that finish first, in seconds: the user's
    ``--distributed-timeout-seconds``, else torch's default (10 min for NCCL and XCCL,
    30 min for gloo, which the CPU build uses)."""
    seconds = getattr(vllm_config.parallel_config, "distributed_timeout_seconds", None)
    if seconds:
        return float(seconds)
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
    default = default_pg_timeout if device == "cpu" else default_pg_nccl_timeout
    return default.total_seconds() if default is not None else 600.0


class LoadSection:
    """This process's slot, taken after construction and given back after processing."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.semaphore: HostSemaphore | None = None
        self.holding: Holding | None = None
        self.vllm_config: Any = None
        self.rank: Any = "?"
        self.slots = 1

    def enter(self, model: Any, vllm_config: Any) -> None:
        if self.holding is not None:
            return  # a second loader (a draft model) inside one section
        from vllm_xpu_memfix.core.host_lock import HostSemaphore, scoped_name

        slots, why = decide(self.settings, model, vllm_config)
        if slots is None:
            logger.debug("vllm-xpu-memfix: load lock not used: %s", why)
            return

        if why.startswith("--max-parallel"):
            logger.info(
                "vllm-xpu-memfix: %s is honoured by the load lock (vLLM's warning that it "
                "will be ignored does not apply with this plugin)",
                why,
            )
        name = scoped_name("load", self.settings.load_scope)
        semaphore = HostSemaphore(self.settings.lock_dir, name, slots)
        try:
            holding = semaphore.acquire(self.settings.load_timeout_s)
        except Exception as exc:
            logger.error("vllm-xpu-memfix: load lock unusable, this rank loads unlocked: %s", exc)
            return
        self.semaphore, self.holding, self.vllm_config = semaphore, holding, vllm_config
        self.slots = slots
        if not holding.acquired:
            logger.warning(
                "vllm-xpu-memfix: load lock: gave up after %.1f s waiting for %s; loading "
                "without the lock (%s)",
                holding.waited_s,
                holding.waited_for,
                config.variable_for("load_timeout_s").name,
            )
        else:
            logger.info(
                "vllm-xpu-memfix: load lock taken (%s%d slot(s)) after waiting %.1f s%s",
                "" if why.startswith(ROOM_SIZED) else f"{why}, ",  # the room's line said why
                slots,
                holding.waited_s,
                f" for {holding.waited_for}" if holding.waited_for else "",
            )

    def leave(self, model: Any = None, on_device: bool = False) -> None:
        """Give the slot back, once this rank's staging is gone: host_release's whole step
        (when that fix is on and the model is at hand), else gc and the allocator's release."""
        if self.semaphore is None or self.holding is None:
            return
        holding, semaphore = self.holding, self.semaphore
        self.semaphore = self.holding = None
        try:
            rss = self._free_staging(model, on_device)
        finally:
            semaphore.release(holding)  # also when freeing the staging failed
        logger.info(
            "vllm-xpu-memfix: rank %s load lock: waited %.1f s%s, held %.1f s, RssAnon at "
            "release %s MiB",
            self.rank,
            holding.waited_s,
            f" for {holding.waited_for}" if holding.waited_for else "",
            holding.held_s,
            f"{rss / MiB:,.0f}",
        )
        self._warn_if_the_queue_outlasts_the_timeout(holding)

    def _free_staging(self, model: Any, on_device: bool) -> int:
        """host_release's step on the loaded model, else gc and the allocator's release;
        returns RssAnon afterwards."""
        from vllm_xpu_memfix.memory import allocator
        from vllm_xpu_memfix.memory.snapshot import take_self

        if model is not None and self.settings.requested(config.HOST_RELEASE):
            from vllm_xpu_memfix.memory.release import LoadedModel, release_loaded_model

            loaded = LoadedModel(model, self.vllm_config, on_device, self.rank)
            line = release_loaded_model(loaded, self.settings)
            if line is not None:
                logger.info("%s", line)
        else:
            allocator.release_free_memory()
        return take_self(pss=False).rss_anon or 0

    def _warn_if_the_queue_outlasts_the_timeout(self, holding: Holding) -> None:
        """Warn where ranks that finished loading wait for the last one inside a collective.

        vLLM's multiprocessing and Ray executors wait for every worker's ``load_model``
        before profiling, with no time-out. Under ``external_launcher`` (torchrun) and
        with several data-parallel engines on the host, finished ranks go on into
        profiling's collectives, bounded by the process-group time-out.
        """
        parallel = self.vllm_config.parallel_config
        backend = getattr(parallel, "distributed_executor_backend", None)
        if backend != "external_launcher" and getattr(parallel, "data_parallel_size", 1) <= 1:
            return
        ranks_per_host = ranks_on_host(self.vllm_config)
        slots = self.slots
        waves = -(-ranks_per_host // slots)
        expected = holding.held_s * (waves - 1)
        limit = distributed_timeout_s(self.vllm_config)
        if expected > 0.8 * limit:
            logger.warning(
                "vllm-xpu-memfix: with %d ranks loading %d at a time, the last may finish "
                "about %.0f s after the first, close to the %.0f s the others may wait in a "
                "collective; raise --distributed-timeout-seconds or %s",
                ranks_per_host,
                slots,
                expected,
                limit,
                config.variable_for("load_slots").name,
            )


def _contained(what: str, step: Callable[[], None]) -> None:
    """Run a step of the plugin's; whatever it raises is logged in one line, never
    passed on to vLLM."""
    try:
        step()
    except Exception as exc:
        logger.error(
            "vllm-xpu-memfix: load lock: %s failed (%s: %s); vLLM goes on",
            what,
            type(exc).__name__,
            exc,
        )


def patches(settings: Settings) -> tuple[Patch, ...]:
    section = LoadSection(settings)

    def after_construction(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        model = wrapped(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        _contained(
            "taking a slot (this rank loads unlocked)", lambda: section.enter(model, vllm_config)
        )
        return model

    def after_processing(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        model = args[0] if args else kwargs.get("model")
        target = args[2] if len(args) > 2 else kwargs.get("target_device")
        on_device = getattr(target, "type", "cpu") != "cpu"
        _contained(
            "freeing this rank's staging and giving the slot back",
            lambda: section.leave(model, on_device),
        )
        return result

    def around_load_model(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        section.rank = getattr(instance, "rank", "?")
        try:
            return wrapped(*args, **kwargs)
        finally:
            # A load that failed inside the section still frees its slot.
            _contained("giving the slot back", section.leave)

    return (
        Patch(FIX.key, f"{_LOADER}:initialize_model", after_construction, params=("vllm_config",)),
        Patch(FIX.key, f"{_LOADER}:process_weights_after_loading", after_processing),
        Patch(FIX.key, "vllm.v1.worker.gpu_worker:Worker.load_model", around_load_model),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(with_platform_overrides(patches(settings)))
