"""The Q4_0 reference against golden data recorded from Intel's compiled library.

``tests/data/q4_0_golden/golden.safetensors`` holds inputs and the outputs of
``quantize_q4_0_to_qweight_and_scale`` in llm-scaler's ``vllm_int4_for_multi_arc.so``
(the build on ``branch-v1.0``; provenance in the file's metadata and the data's
README), recorded by ``scripts/record_q4_0_golden.py``. These are the library's bytes,
not this project's: the reference must reproduce every word and every scale bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from q4_0_cases import load_golden, unfused_q4_0  # noqa: E402

from vllm_xpu_memfix.kernels import q4_0_reference  # noqa: E402

CASES, PROVENANCE = load_golden()
GROUP = int(PROVENANCE["group_size"])


def test_provenance_names_the_library_and_its_hash():
    assert "vllm_int4_for_multi_arc.so" in PROVENANCE["library"]
    assert len(PROVENANCE["library_sha256"]) == 64
    assert GROUP == 64  # the five-argument build fixes the group at 64


def test_the_cases_cover_what_was_asked():
    dtypes = {case["weight"].dtype for case in CASES.values()}
    assert dtypes == {torch.bfloat16, torch.float16, torch.float32}
    assert any(case["weight"].shape[1] % GROUP for case in CASES.values())
    assert {"edges_fp32", "edges_bf16"} <= CASES.keys()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_reference_reproduces_the_library(name):
    case = CASES[name]
    qweight, scales = q4_0_reference.quantize(case["weight"], GROUP)
    assert qweight.shape == case["qweight"].shape
    differ = int((qweight != case["qweight"]).sum())
    assert differ == 0, f"{name}: {differ} of {qweight.numel()} words differ from the library"
    assert torch.equal(scales.view(torch.int16), case["scales"].view(torch.int16)), name


def test_the_edges_hold_what_the_library_decided():
    case = CASES["edges_fp32"]
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = ((case["qweight"].unsqueeze(-1) >> shifts) & 0xF).flatten(1)
    bits = case["scales"].view(torch.int16)
    assert q[0].eq(8).all() and bits[0, 0] == -32768  # all zero: q 8, scale -0.0
    assert q[2][0] == 0 and case["scales"][2, 0] > 0  # negative maximum: positive scale
    assert q[3][1] == 15  # +m against a negative maximum clamps at 15
    assert q[4][3] == 0 and q[4][9] == 15  # equal magnitudes: the first sets the sign
    assert q[5][3] == 0 and q[5][9] == 15
    assert q[14].eq(0).all()  # 1/d overflows: every value 0


def test_the_data_tells_the_two_roundings_apart():
    """At least 200 words where rounding the product first differs from the library:
    a reference that regressed to that rule, or to any other, fails above."""
    differ = {
        name: int((unfused_q4_0(case["weight"], GROUP) != case["qweight"]).sum())
        for name, case in CASES.items()
    }
    assert sum(differ.values()) >= 200, differ
    assert all(differ[f"near_ties_{d}"] >= 100 for d in ("bf16", "fp16", "fp32")), differ
