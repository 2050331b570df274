"""Start-up ledger: where each worker's host memory went, phase by phase.

Problem
    Users of vLLM on Intel GPUs see host RAM fill up during start-up
    (llm-scaler #703, vllm #50269) and cannot tell which of several causes did
    it: a driver-pinned host copy of device memory that no process owns,
    weight staging, allocator retention, page cache or live references.
Mechanism
    From the moment vLLM builds the worker object, takes a snapshot of kernel
    memory figures (``memory.snapshot``) at each start-up phase: process start,
    weights loaded, weights processed (with the bytes of weights the model holds
    in host memory), KV cache sized (with vLLM's byte figure and the worker's
    device, where the KV cache will live), KV cache allocated, warm-up done and
    ready (the first batch outside ``compile_or_warm_up_model``, whose
    V2-runner warm-up runs batches too); the vLLM process tree's PSS is added at
    the first and last. At ready each worker logs a table and one attribution
    line: the parts it knows (a KV cache and weights in host memory) are taken
    out, the driver's host copy is what the host committed (``GPUActive``, else
    MemAvailable less the tree's PSS; ``drm-total-gtt`` is shown as peer imports
    only), and the likely cause is named for what remains; and the host's room then
    (``memory.room``, the figure the load lock and doctor use: MemAvailable, or the
    container's cgroup limit less its usage where smaller).
    Every phase is also a JSON line in the ledger directory
    (``VLLM_XPU_MEMFIX_LEDGER_DIR``, by default under the user's cache), each row with its
    start-up's identity (``core.process.start_identity``). The
    "ready" hook removes itself after the first batch, so nothing stays on the
    per-step path.
Targets
    ``vllm.model_executor.model_loader.base_loader:process_weights_after_loading``
    (module global, called by ``BaseModelLoader.load_model``);
    ``vllm.v1.worker.gpu_worker:Worker.__init__``,
    ``vllm.v1.worker.gpu_worker:Worker.load_model``,
    ``vllm.v1.worker.gpu_worker:Worker.determine_available_memory``,
    ``vllm.v1.worker.gpu_worker:Worker.initialize_from_config``,
    ``vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model``,
    ``vllm.v1.worker.gpu_worker:Worker.execute_model`` (XPUWorker inherits all);
    ``vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory`` and
    ``vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model``, which the
    CPU worker overrides.
Switch
    ``VLLM_XPU_MEMFIX_LEDGER`` (auto = on); ``VLLM_XPU_MEMFIX_LEDGER_DIR``;
    ``VLLM_XPU_MEMFIX_SYSROOT`` roots the room's reads.
Upstream
    None yet. vLLM logs device figures per rank ("Model loading took", "Available
    KV cache memory") but no host figures.
Remove when
    The worker logs host memory per start-up phase itself (``gpu_worker``
    mentions ``RssAnon``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core import config, process
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.process import current_role
from vllm_xpu_memfix.vllm_code.overrides import with_platform_overrides

if TYPE_CHECKING:
    from vllm_xpu_memfix.memory.ledger import Ledger
    from vllm_xpu_memfix.memory.room import Room

logger = get_logger("ledger")

FIX = config.LEDGER
REMOVE_WHEN = RemoveWhen(
    "the worker logs host memory per start-up phase", "vllm.v1.worker.gpu_worker", ("RssAnon",)
)
KEEP_DAYS = 30  # ledger files untouched this long are removed when a start-up begins
_GPU = "vllm.v1.worker.gpu_worker:Worker"
_CPU = "vllm.v1.worker.cpu_worker:CPUWorker"


def host_weight_bytes(model: Any) -> int | None:
    """Bytes of the model's parameters and buffers that live in host memory."""
    try:
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")
    except Exception:
        return None


def device_type(instance: Any) -> str | None:
    """The type of the worker's device (``"cpu"`` on vLLM's CPU backend), where it has one."""
    try:
        device_type = getattr(getattr(instance, "device", None), "type", None)
    except Exception:  # the ledger only observes; a surprise leaves the figure out
        return None
    return device_type if isinstance(device_type, str) else None


class Recorder:
    """This process's ledger, made on first use so that registration imports nothing of it."""

    def __init__(
        self, jsonl_dir: Path | None, sysroot: Path = Path("/"), tree_pss: bool = True
    ) -> None:
        self.jsonl_dir = jsonl_dir
        self.sysroot = sysroot
        self.tree_pss = tree_pss
        self._ledger: Ledger | None = None
        # vLLM's V2 runner runs execute_model inside compile_or_warm_up_model (kernel
        # warm-up, 0.32 v1/worker/gpu_worker.py); "ready" is the first call outside it.
        self.warming_up = 0

    def current(self) -> Ledger:
        if self._ledger is None:
            from vllm_xpu_memfix.memory.ledger import Ledger

            no_tree = None if self.tree_pss else (lambda: None)
            self._ledger = Ledger(str(current_role()), self.jsonl_dir, tree_anon_pss=no_tree)
        return self._ledger

    def note_rank(self, instance: Any) -> None:
        ledger = self.current()
        rank = getattr(instance, "rank", None)
        if ledger.rank is None and isinstance(rank, int):
            ledger.rank = rank

    def record(self, phase: str, instance: Any = None, **extra: Any) -> None:
        try:
            ledger = self.current()
            self.note_rank(instance)
            ledger.record(phase, **extra)
            if ledger.write_error:
                logger.warning(
                    "vllm-xpu-memfix: ledger: %s; JSON lines disabled", ledger.write_error
                )
                ledger.write_error, ledger.jsonl_path = None, None
        except Exception:
            # The ledger only observes; it must never break vLLM's start-up.
            logger.exception("vllm-xpu-memfix: ledger could not record phase %r", phase)

    def report(self, room: Room | None = None) -> None:
        ledger = self.current()
        if not ledger.entries:
            return
        try:
            title = f"vllm-xpu-memfix: host-memory ledger, rank {ledger.rank} ({ledger.role}), MiB"
            logger.info("%s", title)
            for row in ledger.table().splitlines():  # a record per row: each within the limit
                logger.info("%s", row)
            for line in ledger.summary_lines():
                logger.info("vllm-xpu-memfix: rank %s %s", ledger.rank, line)
            if room is not None:
                logger.info(
                    "vllm-xpu-memfix: rank %s host at ready: %s", ledger.rank, room.describe()
                )
        except Exception:
            logger.exception("vllm-xpu-memfix: ledger report failed")

    def room(self) -> Room | None:
        """The host's room now; None where reading it failed (the ledger only observes)."""
        from vllm_xpu_memfix.memory.room import host_room

        try:
            return host_room(self.sysroot)
        except Exception:
            logger.exception("vllm-xpu-memfix: ledger could not read the host's room")
            return None

    def patches(self) -> tuple[Patch, ...]:
        def after_worker_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)  # builds no model; sets the rank
            # The row is written after the worker's imports (seconds): ``began`` says when
            # the process itself started, where the picture places its mark.
            self.record("process start", instance, began=process.began_at())
            return result

        def around_weight_processing(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
            self.record("weights loaded")
            result = wrapped(*args, **kwargs)
            model = kwargs.get("model", args[0] if args else None)
            self.record("weights processed", host_weight_bytes=host_weight_bytes(model))
            return result

        def after_load_model(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            self.note_rank(instance)
            start = time.perf_counter()
            result = wrapped(*args, **kwargs)
            rank = getattr(instance, "rank", "?")
            logger.info(
                "vllm-xpu-memfix: rank %s load_model took %.2f s", rank, time.perf_counter() - start
            )
            # Loaders that bypass base_loader still get the phase, at the end of load_model.
            self.record("weights processed", instance)
            return result

        def after_kv_sizing(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            available = wrapped(*args, **kwargs)
            self.record(
                "KV cache sized",
                instance,
                kv_cache_bytes=available,
                kv_cache_device=device_type(instance),
            )
            return available

        def after(phase: str) -> Any:
            def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
                result = wrapped(*args, **kwargs)
                self.record(phase, instance)
                return result

            return wrapper

        def around_warm_up(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            self.warming_up += 1
            try:
                result = wrapped(*args, **kwargs)
            finally:
                self.warming_up -= 1
            self.record("warm-up done", instance)
            return result

        def at_first_batch(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            room = self.room()
            self.record("ready", instance, room_bytes=room.bytes if room else None)
            self.report(room)
            return wrapped(*args, **kwargs)

        key = FIX.key
        return (
            Patch(
                key,
                "vllm.model_executor.model_loader.base_loader:process_weights_after_loading",
                around_weight_processing,
            ),
            Patch(key, f"{_GPU}.__init__", after_worker_init),
            Patch(key, f"{_GPU}.load_model", after_load_model),
            Patch(key, f"{_GPU}.determine_available_memory", after_kv_sizing),
            Patch(key, f"{_CPU}.determine_available_memory", after_kv_sizing),
            Patch(key, f"{_GPU}.initialize_from_config", after("KV cache allocated")),
            Patch(key, f"{_GPU}.compile_or_warm_up_model", around_warm_up),
            Patch(key, f"{_CPU}.compile_or_warm_up_model", around_warm_up),
            Patch(
                key,
                f"{_GPU}.execute_model",
                at_first_batch,
                once=True,
                counts=lambda: self.warming_up == 0,
            ),
        )


def patches(settings: Settings) -> tuple[Patch, ...]:
    return Recorder(settings.ledger_dir, settings.sysroot).patches()


def install(patcher: Patcher, settings: Settings) -> None:
    """Arm this process's ledger.

    A worker records "process start" when vLLM builds the worker object, so
    ``register()`` stays cheap (it imports nothing of the ledger); other
    processes record it here, and only when their JSON lines are wanted.
    """
    recorder = Recorder(settings.ledger_dir, settings.sysroot)
    patcher.install_all(with_platform_overrides(recorder.patches()))
    role = current_role().role
    if role in ("worker", "ray_worker") or settings.ledger_dir is None:
        return
    if role != "main":
        recorder.record("process start")
        return
    # The process that starts a vLLM instance: the start-up's command line, and the
    # directory kept from growing without end.
    from vllm_xpu_memfix.memory.ledger import prune

    try:
        prune(settings.ledger_dir, KEEP_DAYS * 86400)
    except OSError as exc:
        logger.debug("vllm-xpu-memfix: ledger: old files not removed: %r", exc)
    # A row of its own, without the tree's PSS: registration stays cheap (no psutil), and
    # the tree is this process alone yet.
    starter = Recorder(settings.ledger_dir, settings.sysroot, tree_pss=False)
    starter.record("process start", argv=command_line())


def command_line() -> str:
    """This process's command line (``vllm serve MODEL ...``), secrets already out."""
    from vllm_xpu_memfix.core import redact

    return redact.without_secrets(shlex.join(sys.argv), redact.secret_values(os.environ))
