"""doctor's stable codes, in one place: the verdicts, the phases, and each cause and remedy
with what it means. ``--json`` carries the codes; docs/doctor.md lists them (a test holds
the two together). A code is never renamed: scripts match on it."""

from __future__ import annotations

from vllm_xpu_memfix.core.causes import (
    CONTEXT_EXCEEDS_KV_CACHE,
    DEVICE_OVERCOMMIT,
    DRIVER_HOST_COPY,
    DUPLICATE_INT4_LAYOUT,
    PROCESS_BASELINE,
    QUANT_STAGING,
    SAMPLER_BURST,
    TP_EXCEEDS_GPUS,
    VLLM_REFUSES,
    XE_PEER_CONTEXT_OOM,
)
from vllm_xpu_memfix.intel import driver_facts as dfacts

# --- verdicts, worst last --------------------------------------------------------------

FITS = "fits"
NOT_JUDGED = "not judged"  # nothing failed, and a side had nothing to be judged against
AT_RISK = "at risk"
RUNS_OUT = "will run out of memory"
WILL_FAIL = "will fail"
VERDICTS = (FITS, NOT_JUDGED, AT_RISK, RUNS_OUT, WILL_FAIL)

# --- phases of a start-up, in order ----------------------------------------------------

LOAD = "load"
KV_CACHE = "kv_cache"
WARMUP = "warmup"
PHASES = (LOAD, KV_CACHE, WARMUP)
PHASE_MEANING = {
    LOAD: "weights read and placed on the device, with any on-the-fly quantization",
    KV_CACHE: "after the KV cache is allocated: the device is filled to the utilisation",
    WARMUP: "JIT and sampler warm-up, run after the KV cache has taken its memory",
}
HOST, DEVICE = "host", "device"

# --- causes ----------------------------------------------------------------------------


# The names live in core.causes (the fixes' log records give them too); the meanings here.

CAUSES = {
    DRIVER_HOST_COPY: "compute-runtime >= 26.09 with 2+ Battlemage GPUs in one Level Zero "
    "context pins a host copy of each rank's device allocations (about 1x its device use; "
    "invisible to RSS, not swappable). Largest once the KV cache is allocated "
    "(compute-runtime #953, #980; vllm #50269)",
    XE_PEER_CONTEXT_OOM: "compute-runtime from 25.44 to before 26.22.38646.4 on a kernel "
    "before 7.1 with 2+ Intel GPUs in one context: every device allocation fails with "
    "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY, whatever the memory (compute-runtime #916)",
    QUANT_STAGING: "on-the-fly quantization stages 16-bit weights on the host: the whole "
    "shard of each rank under sym_int4's legacy load (VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1 in "
    "the 0.21 images), one layer at a time otherwise",
    DUPLICATE_INT4_LAYOUT: "llm-scaler 0.21.0-b1's sym_int4 keeps two device layouts of every "
    "quantized weight (ESIMD and transposed oneDNN): about 1.035 instead of 0.535 bytes per "
    "weight element (fixed in 0.21.0-b2, llm-scaler PR #589)",
    SAMPLER_BURST: "the sampler warm-up after KV allocation: the gathered logits (max_num_seqs "
    "x vocab x dtype) and, on XPU's PyTorch fallback, the fp32 and int64 sort copies "
    "(llm-scaler #703: 'Tried to allocate 122.00 MiB' in _dummy_sampler_run)",
    DEVICE_OVERCOMMIT: "weights + KV cache + activations (+ the warm-up) above the device's memory",
    PROCESS_BASELINE: "host memory of the vLLM processes themselves (Python, torch, oneCCL), "
    "taken as 3.5 GiB a rank (an assumption, not a measurement)",
    TP_EXCEEDS_GPUS: "more ranks on this node (engines x TP x PP) than GPUs visible to vLLM: "
    "it refuses to start",
    VLLM_REFUSES: "vLLM refuses the start-up before any memory is used: TP not dividing the "
    "attention heads, --max-model-len above the model's own, a format it does not serve on XPU, "
    "or any other check of its configuration (its own message, where vLLM is installed)",
    CONTEXT_EXCEEDS_KV_CACHE: "the KV cache cannot hold one --max-model-len sequence: vLLM "
    "refuses when it sets the cache up",
}
# Where each cause takes its memory: the main cause of a verdict is on its side.
CAUSE_SIDE = {
    DRIVER_HOST_COPY: HOST,
    QUANT_STAGING: HOST,
    PROCESS_BASELINE: HOST,
    XE_PEER_CONTEXT_OOM: DEVICE,
    DUPLICATE_INT4_LAYOUT: DEVICE,
    SAMPLER_BURST: DEVICE,
    DEVICE_OVERCOMMIT: DEVICE,
    TP_EXCEEDS_GPUS: DEVICE,
    VLLM_REFUSES: DEVICE,
    CONTEXT_EXCEEDS_KV_CACHE: DEVICE,
}

# --- remedies --------------------------------------------------------------------------

DRIVER_GUARD = "driver_guard"
NO_PEER_ACCESS = "no_peer_access"
COMPUTE_RUNTIME_26_05 = "compute_runtime_26_05"
COMPUTE_RUNTIME_26_27 = "compute_runtime_26_27"
KERNEL_7_1 = "kernel_7_1"
LOAD_SLOTS = "load_slots"
PREQUANTIZED_CHECKPOINT = "prequantized_checkpoint"
NEWER_IMAGE = "newer_image"
GPU_MEMORY_UTILIZATION = "gpu_memory_utilization"
KV_HEADROOM = "kv_headroom"
CONTAINER_LIMIT = "container_limit"
MORE_HOST_RAM = "more_host_ram"
MORE_GPUS = "more_gpus"
QUANTIZE = "quantize"
MAX_MODEL_LEN = "max_model_len"
KV_CACHE_DTYPE = "kv_cache_dtype"
TP_FOR_GPUS = "tp_for_visible_gpus"
VLLM_ACCEPTS = "vllm_accepts"
# Remedies that help only together are one remedy, their codes joined by this.
JOINED = "+"

REMEDIES = {
    DRIVER_GUARD: "NEOReadDebugKeys=1 EnableDeferBacking=0 (what the plugin's driver guard "
    "sets): memory is backed at creation, so no host copy is pinned; P2P stays. A debug "
    "key: Intel's interim workaround (vllm #50269)",
    NO_PEER_ACCESS: "NEOReadDebugKeys=1 ForceZeDeviceCanAccessPerReturnValue=0: no peer "
    "access is reported, so no host copy and no #916 failure; costs P2P: "
    + dfacts.NO_PEER_ACCESS_COST,
    COMPUTE_RUNTIME_26_05: "compute-runtime 26.05, the release before defer backing: the "
    "production route Intel's driver maintainer names (compute-runtime #953); an older "
    "driver, and a container needs its image rebuilt on it",
    COMPUTE_RUNTIME_26_27: "compute-runtime 26.27 (or 26.22.38646.4 and later): its P2P "
    "probe reports no P2P on kernels before 7.1, so #916's failure is gone (P2P too there)",
    KERNEL_7_1: "Linux 7.1 or newer on the host: fixes #916's xe bug with P2P kept; does not "
    "remove the host copy",
    LOAD_SLOTS: "let N ranks load at a time (--max-parallel-loading-workers N, honoured by "
    "the plugin's load lock): the host stages N shards instead of every rank's; the load "
    "takes longer",
    PREQUANTIZED_CHECKPOINT: "serve a checkpoint quantized ahead of time: nothing is "
    "converted on the host; needs such a checkpoint of the model",
    NEWER_IMAGE: "an llm-scaler image whose sym_int4 keeps one device layout per weight",
    GPU_MEMORY_UTILIZATION: "a lower --gpu-memory-utilization: less KV cache, so less device "
    "memory and (with the host copy) less pinned host memory; fewer concurrent tokens. Or a "
    "higher one, where the KV cache cannot hold one sequence and the device has room",
    KV_HEADROOM: "the plugin's kv_headroom: keeps the gathered logits plus a slack out of the "
    "KV cache for the sampler warm-up; a little less KV cache",
    CONTAINER_LIMIT: "raise the container's memory limit (docker run --memory)",
    MORE_HOST_RAM: "more host RAM (or fewer GPUs per host)",
    MORE_GPUS: "a larger --tensor-parallel-size over more GPUs: each holds a smaller share of "
    "the weights; needs the GPUs, and TP must divide the attention heads",
    QUANTIZE: "load the weights quantized (-q fp8, or sym_int4 on Intel's images): fewer "
    "device bytes per weight; converted on the host while loading, at some accuracy cost",
    MAX_MODEL_LEN: "the longest --max-model-len whose one sequence the KV cache holds",
    KV_CACHE_DTYPE: "--kv-cache-dtype fp8: one byte a KV element, twice the tokens",
    TP_FOR_GPUS: "a --tensor-parallel-size the visible GPUs hold (or make more GPUs visible) "
    "and that divides the attention heads",
    VLLM_ACCEPTS: "the nearest change of the flags vLLM's refusal names that vLLM's own "
    "configuration accepts (doctor builds it again to know)",
}
