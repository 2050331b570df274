"""The CPU test bed's ``conftest.py`` in upstream-check's patched copy of vLLM.

Not part of any patch: ``scripts/upstream_check.py`` copies it into the copy's root,
where pytest loads it before the patches' tests.

From v0.33/0.34 on, vLLM's CPU platform refuses to configure on an x86 CPU without
Triton's CPU backend (triton-cpu): ``CpuPlatform.check_and_update_config`` raises
"vLLM on x86 CPUs requires Triton (triton-cpu)", and ``Worker.__init__`` raises "vLLM's
model runner requires Triton" unless ``uses_standalone_cpu_model_runner()`` (non-x86
CPUs without Triton). The test bed has the CUDA build of Triton, which vLLM disables
here. For such a release only, this makes vLLM's CPU platform report an ARM CPU, so it
takes its supported no-Triton path. Nothing in the patches' tests runs a Triton kernel
or a model. Releases whose CPU platform has no such path (0.32) are left as they are.
"""

from __future__ import annotations


def _report_arm_where_x86_needs_triton() -> None:
    try:
        from vllm.platforms import current_platform
        from vllm.platforms.interface import CpuArchEnum
        from vllm.triton_utils import HAS_TRITON
    except ImportError:  # not vLLM (upstream-check's own tests use a stand-in package)
        return
    platform = type(current_platform)
    if (
        current_platform.is_cpu()
        and not HAS_TRITON
        and hasattr(platform, "uses_standalone_cpu_model_runner")
        and platform.get_cpu_architecture() == CpuArchEnum.X86
    ):
        platform.get_cpu_architecture = classmethod(lambda cls: CpuArchEnum.ARM)  # type: ignore[method-assign,assignment]


_report_arm_where_x86_needs_triton()


def _engine_environment() -> None:
    """What vLLM's CPU CI jobs set for the tests that start an engine: a fixed KV cache
    size (auto-sizing on this shared VM is not reproducible) and, for TP 2 on a 2-core
    host, one OpenMP thread per rank bound to its own core."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if (os.cpu_count() or 1) <= 3:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


_engine_environment()
