"""What each not-modelled field (``domain``) can do to the start-up, phase by phase: raise
the memory a phase needs, lower it, either, or nothing.

"Lower" means the field could turn a failure there into a start-up that passes the phase:
less memory needed, or a KV cache that holds more tokens. Only a field that can lower
the phase that fails makes the model's "will run out of memory" uncertain
(``limits.stands``); a field that can only raise it, or acts in another phase, leaves the
failure standing. "Either" is the safe class (it caps as a field of unknown effect does),
taken wherever vLLM's code does not settle the direction.

The directions are read from vLLM 0.32.0's code (and 0.34.0's for its own fields), always
relative to what the model already counts: the model counts no LoRA, no draft model, no
graph capture at the KV cache phase, and every attention layer as full attention.
"""

from __future__ import annotations

from vllm_xpu_memfix.startup import domain
from vllm_xpu_memfix.startup.codes import PHASES

RAISE = "raise"
LOWER = "lower"
EITHER = "either"
CAN_LOWER = (LOWER, EITHER)


def _effect(text: str) -> dict[str, str]:
    """``"kv_cache:raise warmup:lower"``: each named phase and its direction; a phase not
    named is not changed. ``"every"``: either way, at every phase."""
    if text == "every":
        return dict.fromkeys(PHASES, EITHER)
    pairs = dict(part.split(":") for part in text.split())
    assert set(pairs) <= set(PHASES) and set(pairs.values()) <= {RAISE, LOWER, EITHER}, text
    return pairs


# (effect, fields, why with its source). Every not-modelled field of ``domain`` is in one
# group: tests/test_domain.py fails on any that is not.
_GROUPS: tuple[tuple[str, str, str], ...] = (
    (
        "kv_cache:raise warmup:lower",
        "enforce_eager",
        "no torch.compile and no graph capture: compile_or_warm_up_model captures graphs only "
        "`if not self.model_config.enforce_eager` (vllm/v1/worker/gpu_worker.py, 0.32.0), and "
        "the graphs' estimate is what determine_available_memory takes from the KV cache, "
        "which the model does not take; the profile's forward pass runs unfused, so its "
        "activations can be larger. Weights load the same.",
    ),
    (
        "kv_cache:either warmup:either",
        """cudagraph_capture_sizes max_cudagraph_capture_size compilation_config
        optimization_level performance_mode max_logprobs max_num_scheduled_tokens
        max_num_active_seqs num_gpu_blocks_override enable_chunked_prefill async_scheduling
        kv_sharing_fast_prefill mamba_config mamba_cache_dtype mamba_ssm_cache_dtype
        mamba_block_size mamba_cache_mode enable_mamba_shared_prefix_checkpoint
        replayssm_buffer_len use_replayssm mm_processor_kwargs skip_mm_profiling
        mm_encoder_attn_backend mm_processor_device mm_ipc_gpu_memory_gb pooler_config
        logits_processors enable_batch_sharded_sampling""",
        "the profile run, the KV cache's size or layout, graphs and the sampler: what runs "
        "after the weights are placed (gpu_worker.determine_available_memory, "
        "compile_or_warm_up_model, 0.32.0); none of them changes a weight.",
    ),
    (
        "warmup:either",
        "enable_flashinfer_autotune",
        "kernel autotuning runs in the warm-up, after the KV cache (gpu_worker.py, 0.32.0)",
    ),
    (
        "kv_cache:raise",
        "disable_sliding_window disable_hybrid_kv_cache_manager kv_cache_dtype_skip_layers",
        "each gives some layers more KV cache bytes per token than vLLM's default (full "
        "attention for window layers, one page size for all layer types, 16-bit KV for the "
        "skipped layers under an 8-bit --kv-cache-dtype); the model already counts every "
        "layer as full attention at the KV cache's dtype, so none can lower its figure",
    ),
    (
        "load:raise kv_cache:raise warmup:raise",
        """enable_lora max_loras max_lora_rank lora_dtype lora_target_modules
        fully_sharded_loras default_mm_loras enable_tower_connector_lora
        specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras
        max_lora_cls_labels speculative_config spec_method spec_model spec_tokens
        enable_return_routed_experts use_fp64_gumbel""",
        "memory the model does not count at all, only ever added: LoRA adapters' stacked "
        "buffers (vllm/lora/), a draft model and its KV cache (vllm/v1/spec_decode/), the "
        "routed-experts record, 64-bit Gumbel noise in the sampler",
    ),
    (
        "load:either",
        """safetensors_load_strategy safetensors_prefetch_num_threads
        safetensors_prefetch_block_size checkpoint_prepare_on_startup""",
        "how the checkpoint is read into host memory while loading",
    ),
    (
        "kv_cache:raise warmup:raise",
        "kv_offloading_size kv_offloading_backend",
        "a host buffer for offloaded KV blocks, allocated with the KV cache "
        "(vllm/v1/kv_offload/, 0.32.0); the model counts none",
    ),
    (
        "load:raise kv_cache:raise warmup:raise",
        "renderer_num_workers max_cpu_loras",
        "more host processes, and LoRA adapters kept in host memory: only ever added",
    ),
    (
        "every",
        """runner convert limit_mm_per_prompt language_model_only mm_encoder_only
        mm_encoder_tp_mode mm_encoder_attn_dtype mm_encoder_fp8_scale_path""",
        "each can change which weights are built: a pooling runner builds no LM head "
        "(no_init_weights on ParallelLMHead in vllm/model_executor/models/adapters.py, "
        "0.32.0), a zero --limit-mm-per-prompt for every modality of a tower builds no tower "
        "(SupportsMultiModal._mark_tower_model, models/interfaces.py), so each can lower "
        "the load as well as later phases",
    ),
    (
        "every",
        """device_ids dcp_q_replicate enable_hc_sp enable_ep_weight_filter moe_backend
        linear_backend sparse_indexer_topk_backend all2all_backend enable_elastic_ep
        elastic_ep_max_dp_size enable_dbo ubatch_size eplb_config enable_eplb
        model_class_overrides disable_custom_all_reduce diffusion_config attention_config
        engram_config kernel_config enable_cumem_allocator model_impl attention_backend
        mamba_backend swa_bounded_replay gdn_prefill_backend kda_prefill_backend
        kda_decode_backend enable_extensible_kv_cache monokernel enable_shm_tensor_arena
        mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb
        max_num_inflight_kv_loads api_server_count""",
        "kernels, placement, backends and buffers whose effect depends on the model and the "
        "platform: not settled from vLLM's code, so the safe class",
    ),
    (
        "every",
        " ".join(name for name, kind in domain.DOMAIN.items() if kind == domain.BOTH),
        "every field that changes both sides: another checkpoint, config, loader, placement, "
        "offload or worker (domain's host-and-device class): any phase, either way",
    ),
)


def _table() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for effect, names, _why in _GROUPS:
        for name in names.split():
            if name in table:
                raise AssertionError(f"{name} has two effects")
            table[name] = _effect(effect)
    return table


# field -> {phase: direction} for the phases it changes
EFFECTS: dict[str, dict[str, str]] = _table()


def can_lower(field: str, phase: str) -> bool:
    """Whether ``field`` could rescue a failure at ``phase``; a field not in the table
    (one of a vLLM this table has not seen) could."""
    effect = EFFECTS.get(field)
    return effect is None or effect.get(phase) in CAN_LOWER
