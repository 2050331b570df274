"""The Q4_0 reference against an element-by-element GGML transliteration, its edge
cases, and the public API's dispatch. The Triton kernel's bit-exactness against
this reference is measured on a GPU by benchmarks/q4_0_device.py (docs/design/device-quant.md)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q4_0_cases import adversarial, ggml_scalar  # noqa: E402

from vllm_xpu_memfix.kernels import (  # noqa: E402
    KernelUnavailable,
    dequantize_q4_0,
    quantize_q4_0,
)
from vllm_xpu_memfix.kernels.q4_0_reference import PACK  # noqa: E402


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(PACK, dtype=torch.int32) * 4
    return ((qweight.unsqueeze(-1) >> shifts) & 0xF).flatten(1)


def assert_matches_ggml(weight: torch.Tensor, group_size: int) -> None:
    qweight, scales = quantize_q4_0(weight, group_size)
    n, k = weight.shape
    kp = -(-k // group_size) * group_size
    padded = np.zeros((n, kp), dtype=np.float32)
    padded[:, :k] = weight.float().numpy()
    q = unpack(qweight)
    for r in range(n):
        expected_q, expected_scales = ggml_scalar(padded[r], group_size)
        assert q[r].tolist() == expected_q, f"row {r}"
        got = scales[r].numpy().view(np.uint16).tolist()
        assert got == [int(s.view(np.uint16)) for s in expected_scales], f"row {r} scales"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "group"), [(3, 128, 128), (5, 300, 128), (7, 96, 32)])
def test_random_weights_match_ggml_bit_for_bit(dtype, n, k, group):
    torch.manual_seed(n * k)
    assert_matches_ggml(torch.randn(n, k).to(dtype) * 0.05, group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adversarial_groups_match_ggml(dtype):
    assert_matches_ggml(adversarial(64, dtype), 64)


def test_edge_case_values():
    weight = adversarial(32, torch.float32)
    qweight, scales = quantize_q4_0(weight, 32)
    q = unpack(qweight)
    # All-zero group: d = -0.0 (0x8000 stored), every q = 8.
    assert scales[0].view(torch.int16).item() == -32768
    assert q[0].tolist() == [8] * 32 and q[1].tolist() == [8] * 32
    # Equal magnitudes: the first sets the sign of d.
    assert scales[2].item() == -0.25 and scales[3].item() == 0.25
    assert q[2][3].item() == 0 and q[2][9].item() == 15  # +2 -> 8 - 8 = 0, -2 -> 16 -> 15
    # m = -8: d = 1; x = k + 0.5 lands on an integer and rounds up.
    assert scales[4].item() == 1.0
    assert q[4][:3].tolist() == [0, 2, 3]  # -8 + 8.5 -> 0; -6.5 + 8.5 = 2.0 -> 2; -5.5 -> 3
    assert q[4][8].item() == 9 and q[4][15].item() == 15  # 0.5 -> 9.0; 7.5 -> 16 -> 15
    # Positive values of the opposite sign clamp at 15.
    assert q[5][0].item() == 15 and q[5][1].item() == 0


def test_padding_is_zero_and_shapes_follow_the_group():
    weight = torch.randn(4, 300)
    qweight, scales = quantize_q4_0(weight, 128)
    assert qweight.shape == (4, 384 // 8) and qweight.dtype == torch.int32
    assert scales.shape == (4, 3) and scales.dtype == torch.float16
    assert unpack(qweight)[:, 300:].eq(8).all()  # zeros quantize to 8
    restored = dequantize_q4_0(qweight, scales, 128)
    assert restored.shape == (4, 384) and restored[:, 300:].eq(0).all()


def test_round_trip_error_is_bounded_by_the_scale():
    torch.manual_seed(1)
    weight = torch.randn(16, 512)
    qweight, scales = quantize_q4_0(weight, 128)
    error = (dequantize_q4_0(qweight, scales, 128) - weight).abs().view(16, 4, 128)
    bound = scales.float().abs().unsqueeze(-1) * 1.0001  # clamped values are off by up to d
    assert (error <= bound).all()
    assert error.mean() < scales.float().abs().mean() / 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad):
    weight = torch.randn(2, 128)
    weight[1, 7] = bad
    with pytest.raises(ValueError, match="inf or NaN in 1 element"):
        quantize_q4_0(weight)


def test_fp32_maximum_beyond_fp16_gives_an_infinite_scale_like_ggml():
    weight = torch.zeros(1, 128)
    weight[0, 0] = 1e6
    _, scales = quantize_q4_0(weight)
    assert scales[0, 0].item() == float("-inf")


@pytest.mark.parametrize(
    ("weight", "group", "message"),
    [
        (torch.zeros(4), 128, "must be 2-D"),
        (torch.zeros(2, 128, dtype=torch.int32), 128, "dtype must be"),
        (torch.zeros(2, 128), 100, "power of two"),
        (torch.zeros(2, 128), 4, "power of two"),
    ],
)
def test_bad_input_gets_a_clear_error(weight, group, message):
    with pytest.raises(ValueError, match=message):
        quantize_q4_0(weight, group)


def test_mismatched_scales_are_refused():
    qweight, scales = quantize_q4_0(torch.randn(2, 256))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_q4_0(qweight, scales[:, :1])


def test_unsupported_device_says_why():
    weight = torch.randn(2, 128, device="meta")
    with pytest.raises(KernelUnavailable, match="'meta'"):
        quantize_q4_0(weight)
