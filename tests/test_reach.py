"""startup.reach: each not-modelled field's effect, phase by phase and by direction, and
the verdicts it leaves standing or caps (issue 51, class 4). Serve lines are llm-scaler's
own (vllm/README.md at 8d66bf9, the DeepSeek-R1-Distill-Qwen-7B examples, lines 367-382),
on the real Qwen3-32B config.json (tests/data/configs) and a described B70."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_startup import B70, machine
from test_startup_domain import judge

from vllm_xpu_memfix.startup import codes, domain, limits, phases, reach

# llm-scaler's line with its model swapped for a 32B in BF16 (no -q): 65 GB of weights
# against one 32 GiB card.
INTEL_LINE = (
    "--dtype=float16", "--enforce-eager", "--port", "8000", "--host", "0.0.0.0",
    "--trust-remote-code", "--disable-sliding-window", "--gpu-memory-util=0.9",
    "--max-num-batched-tokens=8192", "--max-model-len=8192", "--block-size", "64", "-tp=1",
)  # fmt: skip


def test_every_not_modelled_field_has_an_effect_and_no_other_field_does():
    not_modelled = {n for n, k in domain.DOMAIN.items() if k in domain.NOT_MODELLED_SIDES}
    assert sorted(not_modelled - set(reach.EFFECTS)) == [], "classify these in startup/reach.py"
    assert sorted(set(reach.EFFECTS) - not_modelled) == []


def test_enforce_eager_lowers_only_the_warm_up():
    effect = reach.EFFECTS["enforce_eager"]
    assert [p for p in codes.PHASES if reach.can_lower("enforce_eager", p)] == [codes.WARMUP]
    assert effect[codes.KV_CACHE] == reach.RAISE and codes.LOAD not in effect


def test_a_field_this_table_has_not_seen_could_lower_any_phase():
    assert all(reach.can_lower("a_field_of_a_later_vllm", phase) for phase in codes.PHASES)


def test_enforce_eager_does_not_change_a_verdict_whose_failure_is_at_load(tmp_path):
    without = tuple(flag for flag in INTEL_LINE if flag != "--enforce-eager")
    plain = judge(tmp_path, machine(1, B70), "qwen3-32b", *without)
    eager = judge(tmp_path, machine(1, B70), "qwen3-32b", *INTEL_LINE)
    at_load = {"phase": codes.LOAD, "where": codes.DEVICE}
    assert (plain.verdict, plain.fails_at) == (codes.RUNS_OUT, at_load)
    assert (eager.verdict, eager.fails_at, eager.main_cause) == (
        plain.verdict,
        plain.fails_at,
        plain.main_cause,
    )
    assert eager.why.endswith(
        "--enforce-eager, --disable-sliding-window set, which cannot lower the load phase"
    )


def test_a_field_that_can_build_fewer_weights_still_caps_a_load_failure(tmp_path):
    """A pooling runner builds no LM head (vllm/model_executor/models/adapters.py): it
    could lower the load, so the same failure is at most at risk, and named."""
    out = judge(tmp_path, machine(1, B70), "qwen3-32b", *INTEL_LINE, "--runner", "pooling")
    assert out.verdict == codes.AT_RISK and out.fails_at is None
    assert "not modelled on the device: --runner can lower it" in out.why


@pytest.mark.parametrize(
    ("phase", "capped"), [(codes.LOAD, False), (codes.KV_CACHE, False), (codes.WARMUP, True)]
)
def test_enforce_eager_caps_a_failure_at_the_warm_up_only(tmp_path, phase, capped):
    inputs = phases.Inputs(tp=1, utilization=0.9, device_bytes=32 * 2**30)
    eager = replace(inputs, not_modelled=("--enforce-eager",))
    assert limits.stands(inputs, codes.DEVICE, "fails", phase) == (True, "fails")
    assert limits.stands(eager, codes.DEVICE, "fails", phase)[0] is not capped
