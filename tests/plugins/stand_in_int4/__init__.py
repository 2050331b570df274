"""Test-only vLLM plugin: on-the-fly int4 weight quantization that stages on the host.

It stands in for llm-scaler's sym_int4, which only Intel's images ship: in
``process_weights_after_loading`` each linear weight goes bf16 -> fp32 copy ->
packed int4 plus fp16 group scales, and the bf16 weight is dropped, the same host
staging pattern. Forward passes dequantize on the fly. Registered through vLLM's
out-of-tree quantization registry; loaded by vLLM's general-plugin entry point.
"""

GROUP = 128


def register() -> None:
    import torch
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class StandInInt4LinearMethod(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight = layer.weight.data
            n, k = weight.shape
            staging = weight.float().contiguous()  # the fp32 host copy
            groups = staging.view(n, k // GROUP, GROUP)
            scales = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 7
            q = (groups / scales).round().clamp(-8, 7).to(torch.int8) + 8
            q = q.view(n, k).to(torch.uint8)
            layer.qweight = torch.nn.Parameter(
                (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), requires_grad=False
            )
            layer.scales = torch.nn.Parameter(scales.squeeze(-1).half(), requires_grad=False)
            layer.register_parameter("weight", None)
            del staging, groups, q

        def apply(self, layer, x, bias=None):
            packed = layer.qweight
            q = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
            n, k = q.shape
            w = (
                (
                    (q.to(torch.float32) - 8).view(n, k // GROUP, GROUP)
                    * layer.scales.float().unsqueeze(-1)
                )
                .view(n, k)
                .to(x.dtype)
            )
            return torch.nn.functional.linear(x, w, bias)

    @register_quantization_config("stand_in_int4")
    class StandInInt4Config(QuantizationConfig):
        @classmethod
        def get_name(cls):
            return "stand_in_int4"

        @classmethod
        def get_supported_act_dtypes(cls):
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls):
            return -1

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            return StandInInt4LinearMethod() if isinstance(layer, LinearBase) else None
