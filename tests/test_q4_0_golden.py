"""The Q4_0 reference against golden data recorded from two builds of Intel's compiled library.

``tests/data/q4_0_golden/<build>-g<group>.safetensors`` hold inputs and the outputs of
``quantize_q4_0_to_qweight_and_scale`` in two builds of llm-scaler's
``vllm_int4_for_multi_arc.so``: the five-argument build on ``branch-v1.0`` (group 64) and
the six-argument build added to llm-scaler by pull request #334's commits (groups 32, 64
and 128); provenance in each file's metadata and the data's README, recorded by
``scripts/record_q4_0_golden.py``. These are the libraries' bytes, not this project's: the
reference must reproduce every word and every scale bit of each.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from q4_0_cases import golden_files, load_golden, unfused_q4_0  # noqa: E402

from vllm_xpu_memfix.kernels import q4_0_reference  # noqa: E402

BRANCH_V1 = "74fd3e0834e9ad5d09e50ec14f48f49b27467a69a49b598fee1fe92dac2e7315"
PR334_6ARG = "855426de598041a081d2c8f37dd37764dc37eeee040c0114deb77ec057c265cd"
RECORDINGS = {path.stem: load_golden(path) for path in golden_files()}
CASES = [(stem, name) for stem, (cases, _) in RECORDINGS.items() for name in sorted(cases)]


def group_of(stem: str) -> int:
    return int(RECORDINGS[stem][1]["group_size"])


def test_the_recordings_are_the_two_builds_at_the_groups_the_docs_name():
    found = {(p["library_sha256"], int(p["group_size"])) for _, p in RECORDINGS.values()}
    assert found == {(BRANCH_V1, 64), (PR334_6ARG, 32), (PR334_6ARG, 64), (PR334_6ARG, 128)}


@pytest.mark.parametrize("stem", sorted(RECORDINGS))
def test_provenance_names_the_build_its_compiler_and_its_call(stem):
    _, provenance = RECORDINGS[stem]
    group = group_of(stem)
    assert stem.endswith(f"-g{group}")
    assert "vllm_int4_for_multi_arc.so" in provenance["library"]
    assert re.fullmatch("[0-9a-f]{64}", provenance["library_sha256"])
    assert provenance["compiler"].startswith("GCC")
    arguments = provenance["function"].count(",") + 1
    if provenance["library_sha256"] == BRANCH_V1:
        assert arguments == 5 and group == 64  # the five-argument build fixes the group
    else:
        assert arguments == 6
        assert f"N, Kp, {group});" in provenance["call"]  # the group passed as the sixth


@pytest.mark.parametrize("stem", sorted(RECORDINGS))
def test_the_cases_cover_what_was_asked(stem):
    cases, _ = RECORDINGS[stem]
    group = group_of(stem)
    dtypes = {case["weight"].dtype for case in cases.values()}
    assert dtypes == {torch.bfloat16, torch.float16, torch.float32}
    assert any(case["weight"].shape[1] % group for case in cases.values())
    assert {"edges_fp32", "edges_bf16"} <= cases.keys()


@pytest.mark.parametrize(("stem", "name"), CASES)
def test_the_reference_reproduces_the_library(stem, name):
    case = RECORDINGS[stem][0][name]
    qweight, scales = q4_0_reference.quantize(case["weight"], group_of(stem))
    assert qweight.shape == case["qweight"].shape
    differ = int((qweight != case["qweight"]).sum())
    assert differ == 0, f"{stem} {name}: {differ} of {qweight.numel()} words differ from it"
    assert torch.equal(scales.view(torch.int16), case["scales"].view(torch.int16)), (stem, name)


@pytest.mark.parametrize("stem", sorted(RECORDINGS))
def test_the_edges_hold_what_the_library_decided(stem):
    case = RECORDINGS[stem][0]["edges_fp32"]
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = ((case["qweight"].unsqueeze(-1) >> shifts) & 0xF).flatten(1)
    bits = case["scales"].view(torch.int16)
    assert q[0].eq(8).all() and bits[0, 0] == -32768  # all zero: q 8, scale -0.0
    assert q[2][0] == 0 and case["scales"][2, 0] > 0  # negative maximum: positive scale
    assert q[3][1] == 15  # +m against a negative maximum clamps at 15
    assert q[4][3] == 0 and q[4][9] == 15  # equal magnitudes: the first sets the sign
    assert q[5][3] == 0 and q[5][9] == 15
    assert q[14].eq(0).all()  # 1/d overflows: every value 0


def test_both_builds_give_the_same_bytes_at_group_64():
    """What the two builds share: at group 64, on the same inputs, every word and scale bit."""
    (first, _), (second, _) = RECORDINGS["branch-v1.0-g64"], RECORDINGS["pr334-6arg-g64"]
    assert first.keys() == second.keys()
    for name in first:
        for part in ("weight", "qweight", "scales"):
            a, b = first[name][part], second[name][part]
            assert a.dtype == b.dtype and a.shape == b.shape, (name, part)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, part)


@pytest.mark.parametrize("stem", sorted(RECORDINGS))
def test_the_data_tells_the_two_roundings_apart(stem):
    """At least 100 words per near-tie case where rounding the product first differs from
    the library: a reference that regressed to that rule, or to any other, fails above."""
    cases, _ = RECORDINGS[stem]
    differ = {
        name: int((unfused_q4_0(case["weight"], group_of(stem)) != case["qweight"]).sum())
        for name, case in cases.items()
    }
    assert all(differ[f"near_ties_{d}"] >= 100 for d in ("bf16", "fp16", "fp32")), differ
