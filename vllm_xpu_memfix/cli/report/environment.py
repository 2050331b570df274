"""Which environment variables ``report`` shows: an allow-list of those that bear on a
memory report, never a guess from a name. Shown: the plugin's switches; vLLM's, Level
Zero's, SYCL's and the Unified Runtime's memory and device settings; the Intel driver's
variables the plugin knows (``intel.driver_facts``); allocator settings. Any other
variable of those families is named with its value withheld; the rest is not mentioned.
Every value still passes through the report's one redactor."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.intel import catalog, driver_facts

VLLM_MEMORY = frozenset(
    {
        "VLLM_PLUGINS",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_USE_V1",
        "VLLM_TARGET_DEVICE",
        "VLLM_ATTENTION_BACKEND",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
        "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT",  # Intel's sym_int4 legacy load
        "VLLM_DISABLE_COMPILE_CACHE",
        "VLLM_SKIP_P2P_CHECK",
        catalog.Q40_LIB,
    }
)
LEVEL_ZERO = frozenset(
    {"ZE_ENABLE_PCI_ID_DEVICE_ORDER", "ZES_ENABLE_SYSMAN", "CCL_ATL_TRANSPORT"}
    | {v.name for v in driver_facts.VARIABLES}
)
ALLOCATOR = frozenset({"LD_PRELOAD"})
# Families whose every member is a setting of memory or device placement.
ALLOCATOR_PREFIXES = ("MALLOC_", "TCMALLOC_", "JEMALLOC_")
SHOWN_PREFIXES = ("SYCL_", "UR_L0_", "CCL_ZE_", *ALLOCATOR_PREFIXES)
_ALLOC_CONF = re.compile(r"PYTORCH_\w*ALLOC_CONF")
# Families a triager knows: a member not allow-listed is named, its value withheld
# (``VLLM_HOST_IP``, ``VLLM_API_KEY``, ``HF_TOKEN``).
FAMILIES = (
    "VLLM_",
    "ZE_",
    "ZES_",
    "ONEAPI_",
    "SYCL_",
    "UR_",
    "CCL_",
    "NEO",
    "PYTORCH_",
    "TORCH_",
    "HF_",
    "HUGGING_FACE_",
    "RAY_",
    "I_MPI_",
)


def shown(name: str) -> bool:
    return (
        name.startswith(config.PREFIX)
        or name in VLLM_MEMORY | LEVEL_ZERO | ALLOCATOR
        or name.startswith(SHOWN_PREFIXES)
        or bool(_ALLOC_CONF.fullmatch(name))
    )


def allocator_setting(name: str) -> bool:
    return (
        name in ALLOCATOR
        or name.startswith(ALLOCATOR_PREFIXES)
        or bool(_ALLOC_CONF.fullmatch(name))
    )


@dataclass(frozen=True)
class Environment:
    shown: list[tuple[str, str]]  # (name, value), by name
    withheld: list[str]  # names of the families' other members


def read(environ: Mapping[str, str]) -> Environment:
    names = sorted(environ)
    return Environment(
        [(n, environ[n]) for n in names if shown(n)],
        [n for n in names if not shown(n) and n.startswith(FAMILIES)],
    )
