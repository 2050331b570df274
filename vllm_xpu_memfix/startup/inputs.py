"""What the start-up model reads (:class:`Inputs`), and what follows from it alone: the
weights per rank, the staging, the KV cache and the tokens it holds, the driver's host
copy. The phases and the verdict are ``startup.phases``'; ``startup.limits`` and
``startup.causes`` read these inputs without importing the judgement."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.intel import driver
from vllm_xpu_memfix.intel import driver_facts as dfacts
from vllm_xpu_memfix.memory.estimate import BurstEstimate
from vllm_xpu_memfix.startup import reserve, staging
from vllm_xpu_memfix.startup.known import Known, Source, exact
from vllm_xpu_memfix.startup.kv_layout import UNREAD, KvLayout

# Host RAM of the vLLM processes themselves, per rank: vllm #50269's maintainers
# call ~15 GB normal on 4x B60 and ~10 GB on one CUDA GPU.
BASELINE_PER_RANK = 3.5 * GiB
# What an Inputs built by hand (not by ``sizing``) holds where it names nothing.
SIXTEEN_BIT = exact(2.0, "16-bit weights", Source.GIVEN)
NO_FORWARD = exact(0.0, "no forward pass", Source.GIVEN)


@dataclass(frozen=True)
class Inputs:
    """Everything the model reads. Bytes unless named otherwise; None is unknown; a
    :class:`Known` is a range with its provenance. The properties are the worst case (each
    range's high end); :func:`run` judges both ends (:func:`corner`)."""

    tp: int
    utilization: float
    device_bytes: float | None
    pp: int = 1
    ranks_here: int = 0  # the ranks this host runs (engines x TP x PP here); 0: TP x PP
    engines_here: int = 1
    ranks_placed: bool = True  # False under Ray: ranks may run on other nodes
    expert_ranks: int = 1  # DP engines sharing the experts under expert parallel
    stage_share: float = 1.0  # the largest pipeline stage's share of the weights
    expert_share: float = 0.0  # the experts' share of the weights
    other_weight_bytes: float = 0.0  # on the device, all ranks together
    linear_params: float = 0.0
    linear_bytes_per_weight: Known = SIXTEEN_BIT  # on the device
    prequantized: bool = False
    cpu_offload_bytes: float = 0.0  # per rank, --cpu-offload-gb
    int4_layouts: int = 0  # 0: not sym_int4; 1 or 2 device layouts per weight
    on_the_fly: bool = False  # 16-bit weights converted while loading
    unit_params: float = 0.0  # the largest unit converted at once, all ranks together
    shard_16bit: float = 0.0  # the 16-bit checkpoint, all ranks together
    legacy_load: bool = False
    load_mode_why: str = ""
    staging_slots: int | None = None
    kv_cache_bytes: float | None = None  # --kv-cache-memory-bytes
    activation_bytes: Known = NO_FORWARD  # per rank, the profile run's forward pass
    burst: BurstEstimate | None = None
    kv_headroom: bool = False
    kv_headroom_slack: float = reserve.DEFAULT_SLACK
    kv_layout: KvLayout | None = None  # what one sequence holds (startup.kv_layout)
    kv_per_token: Known | None = None  # per rank, where no layout is read (kv_layout.UNREAD)
    kv_cache_dtype: str = "auto"
    kv_element_bytes: int = 2
    max_model_len: int | None = None  # as given, else the model's own
    max_model_len_fitted: bool = False  # -1 / auto: vLLM fits it to the KV cache
    model_max_len: int | None = None
    attention_heads: int | None = None
    refusals: tuple[str, ...] = ()  # vLLM's reasons to refuse, read before any memory
    checked_tp: int = 0  # the TP at which vLLM's own checks ran (refusals); 0: none ran
    not_modelled: tuple[str, ...] = ()  # flags set that the model does not cover
    gpus_in_context: int = 0
    battlemage_in_context: int = 0
    runtime: driver.Runtime | None = None
    kernel: driver.Kernel | None = None
    defer_backing_off: bool = False
    peer_access_off: bool = False
    p2p: bool | None = None  # peer access between the GPUs; None: not known
    plugin: bool = True  # the plugin is installed where it will serve
    baseline: float = BASELINE_PER_RANK
    room: float | None = None
    swap: float = 0.0

    @property
    def host_ranks(self) -> int:
        return self.ranks_here or self.tp * self.pp

    @property
    def loaded(self) -> float:
        """Per rank, the weights of the largest stage before any CPU offload."""
        linear = self.linear_params * self.linear_bytes_per_weight.high
        experts = 1 - self.expert_share + self.expert_share / self.expert_ranks
        return (self.other_weight_bytes + linear) * experts * self.stage_share / self.tp

    @property
    def offloaded(self) -> float:
        """Per rank, the weights --cpu-offload-gb keeps in host memory."""
        return min(self.cpu_offload_bytes, self.loaded)

    @property
    def weights(self) -> float:
        """Per rank, as the device holds them once loaded."""
        return self.loaded - self.offloaded

    @property
    def staging(self) -> float:
        """Host bytes per rank that convert weights during the load."""
        if not self.on_the_fly:
            return 0.0
        shard = self.shard_16bit * self.stage_share / self.tp if self.legacy_load else 0.0
        return staging.per_rank(self.unit_params / self.tp, shard_bytes=shard)

    @property
    def staging_ranks(self) -> int:
        if self.staging and self.staging_slots:
            return min(self.host_ranks, self.staging_slots)
        return self.host_ranks

    def kv_of(self) -> tuple[KvLayout, float] | None:
        """The KV layout and its element's bytes: the layout read, else (``UNREAD``) the
        high end of the bytes per token; None where no KV cache is kept or nothing is
        known of it."""
        if self.kv_layout is not None:
            return (self.kv_layout, self.kv_element_bytes) if self.kv_layout.allocates else None
        return None if self.kv_per_token is None else (UNREAD, self.kv_per_token.high)

    @property
    def kv_bytes_per_token(self) -> float | None:
        """Per rank, what a long sequence adds per token (the layers keeping every one)."""
        kv = self.kv_of()
        return kv[0].per_token(self.tp, kv[1]) if kv else None

    @property
    def kv_tokens(self) -> int | None:
        """The longest sequence one rank's KV cache holds, at most the judged context (or
        the model's own), as vLLM sizes one sequence (``KvLayout.tokens_within``)."""
        kv, found = self.kv_cache, self.kv_of()
        if kv is None or found is None:
            return None
        limit = self.max_model_len or self.model_max_len or 2**31 - 1
        return found[0].tokens_within(max(kv, 0.0), self.tp, found[1], limit)

    @property
    def debug_keys(self) -> dfacts.DebugKeys:
        """The driver keys the serving processes start with, as the driver reads them."""
        env = {dfacts.READ_DEBUG_KEYS: "1"}
        if self.defer_backing_off:
            env[dfacts.DEFER_BACKING] = "0"
        if self.peer_access_off:
            env[dfacts.FORCE_PEER_ACCESS] = "0"
        return dfacts.debug_keys(env)

    @property
    def host_copy(self) -> bool:
        """Whether the driver pins a host copy (an unknown runtime counts as affected)."""
        return (
            driver.why_no_host_copy(
                self.gpus_in_context, self.battlemage_in_context, self.runtime, self.debug_keys
            )
            is None
        )

    @property
    def xe_peer_condition(self) -> driver.XePeerOom | None:
        """compute-runtime #916's condition, with the parts not known (None: ruled out)."""
        return driver.xe_peer_oom(
            self.gpus_in_context,
            self.runtime,
            self.kernel,
            self.peer_access_off,
            self.p2p,
        )

    @property
    def peer_oom(self) -> bool | None:
        """compute-runtime #916 will strike (True), cannot (False), or a part of its
        condition is not known (None)."""
        oom = self.xe_peer_condition
        return False if oom is None else (True if oom.certain else None)

    @property
    def reserve(self) -> float:
        """kv_headroom's reserve (``reserve.kv_reserve``), where it takes one."""
        if not self.kv_headroom or self.burst is None or self.kv_cache_bytes is not None:
            return 0.0
        return float(reserve.kv_reserve(self.burst, self.kv_headroom_slack))

    @property
    def profile_peak(self) -> float:
        return self.activation_bytes.high + (self.burst.peak if self.burst else 0.0)

    @property
    def kv_cache(self) -> float | None:
        """Per rank: the KV cache vLLM allocates (negative: the weights leave none)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if self.device_bytes is None:
            return None
        budget = self.utilization * self.device_bytes
        return budget - self.weights - self.profile_peak - self.reserve


@dataclass(frozen=True)
class Phase:
    host: float
    device: float | None
    pinned: float  # the host copy's share of ``host``
