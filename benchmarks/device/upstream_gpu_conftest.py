"""Stand-in for vLLM's tests/conftest.py on the CUDA machine (which has vLLM's Python but
none of its compiled parts): what importing the touched modules needs of the compiled ones.

- ``vllm.vllm_flash_attn``: its package raises ImportError without the ``_vllm_fa2_C`` /
  ``_vllm_fa3_C`` extensions; a module with the names ``fa_utils`` imports stands in. No
  test here runs an attention kernel: calling one raises.
- ``vllm._custom_ops.cutlass_scaled_mm_supports_*``: ask ``torch.ops._C`` at import time of
  the FP8 utilities; the stand-ins answer False (no CUTLASS FP8).
- the model registry inspects a model class in a subprocess, which these stand-ins would not
  reach: it runs in-process here.
- ``anthropic``, ``openai_harmony``: clients vLLM's tests/utils.py imports; where their
  wheels were not carried, a module whose every attribute is a placeholder class stands in.
The results file names these stand-ins.
"""

import sys
import types


def _missing(*_args, **_kwargs):
    raise NotImplementedError("stand-in: vLLM's compiled flash attention is not installed")


_fa = types.ModuleType("vllm.vllm_flash_attn")
for _name in (
    "compile_flash_attn_varlen_func_from_specs",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "fa_version_unsupported_reason",
):
    setattr(_fa, _name, _missing)
_fa.is_fa_version_supported = lambda *_a, **_k: False
_fa.FA2_AVAILABLE = _fa.FA3_AVAILABLE = False
sys.modules["vllm.vllm_flash_attn"] = _fa

import vllm._custom_ops as _ops  # noqa: E402

for _name in dir(_ops):
    if _name.startswith("cutlass_scaled_mm_supports_"):
        setattr(_ops, _name, lambda *_a, **_k: False)


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def placeholder(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module.__getattr__ = placeholder  # type: ignore[method-assign]
    return module


for _client in ("anthropic", "openai_harmony"):
    try:  # the real client where its wheel was carried
        __import__(_client)
    except ImportError:
        sys.modules[_client] = _placeholder_module(_client)

import vllm.model_executor.models.registry as _registry  # noqa: E402

_registry._run_in_subprocess = lambda fn: fn()
