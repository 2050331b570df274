"""Registers the replayed ``sym_int4`` as vLLM's ``--quantization sym_int4``.

Intel's images add the name to vLLM's quantization registry in their patch; the replay
does it through vLLM's out-of-tree registry, from this ``vllm.general_plugins`` entry
point, so every vLLM process knows the name.
"""


def register() -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.sym_int4 import SymInt4Config

    register_quantization_config("sym_int4")(SymInt4Config)
