"""doctor's cause codes, named here so that the fixes' log records can give them too.

What each means is in ``startup/codes.py`` (``CAUSES``); its section of
docs/troubleshooting.md has the code as its anchor (``core.log.see``). A code is never
renamed: scripts match on it.
"""

DRIVER_HOST_COPY = "driver_host_copy"
XE_PEER_CONTEXT_OOM = "xe_peer_context_oom"
QUANT_STAGING = "quant_staging"
DUPLICATE_INT4_LAYOUT = "duplicate_int4_layout"
SAMPLER_BURST = "sampler_burst"
DEVICE_OVERCOMMIT = "device_overcommit"
PROCESS_BASELINE = "process_baseline"
TP_EXCEEDS_GPUS = "tp_exceeds_gpus"
VLLM_REFUSES = "vllm_refuses"
CONTEXT_EXCEEDS_KV_CACHE = "context_exceeds_kv_cache"
