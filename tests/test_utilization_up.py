"""Remedies both ways (issue 51, class 6): a KV cache too small for one sequence at a low
--gpu-memory-utilization, on a device with room, gets the utilisation that holds it,
judged by the model like every remedy. The real Llama-3.1-8B-Instruct-FP8 config.json
(tests/data/configs) on a described 32 GiB B70."""

from __future__ import annotations

from test_startup import B60, B70, machine
from test_startup_domain import judge

from vllm_xpu_memfix.startup import codes, remedies

LONG = ("--max-model-len", "131072")


def utilisation_remedy(out):
    found = [r for r in remedies.remedies(out).remedies if r.code == codes.GPU_MEMORY_UTILIZATION]
    return found[0] if found else None


def test_a_kv_cache_too_small_at_0_3_gets_the_lowest_utilisation_that_holds_one_sequence(
    tmp_path,
):
    name = "llama-3.1-8b-instruct-fp8"
    low = judge(tmp_path, machine(1, B70), name, "--gpu-memory-utilization", "0.3", *LONG)
    assert low.verdict == codes.RUNS_OUT
    assert low.fails_at == {"phase": codes.KV_CACHE, "where": codes.DEVICE}
    remedy = utilisation_remedy(low)
    assert remedy is not None and remedy.after.verdict == codes.FITS
    value = float(remedy.what.split()[-1])
    assert 0.3 < value < 0.9
    # The model's own answer at that value, and one step below it, on the same command.
    at = judge(tmp_path, machine(1, B70), name, "--gpu-memory-utilization", f"{value}", *LONG)
    below = f"{value - 0.01:.2f}"
    under = judge(tmp_path, machine(1, B70), name, "--gpu-memory-utilization", below, *LONG)
    assert at.verdict == codes.FITS and under.verdict == codes.RUNS_OUT


def test_no_higher_utilisation_is_offered_where_the_device_has_no_room(tmp_path):
    """On a 24 GB B60 the 8B's full context does not fit at any utilisation."""
    name = "llama-3.1-8b-instruct-fp8"
    out = judge(tmp_path, machine(1, B60), name, "--gpu-memory-utilization", "0.3", *LONG)
    assert out.verdict == codes.RUNS_OUT and utilisation_remedy(out) is None
