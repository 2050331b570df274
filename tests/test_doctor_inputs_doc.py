"""docs/doctor.md's inputs table has a row for every input of the start-up model
(``startup.inputs.Inputs``): a field added to the model without saying where it comes from
and what is assumed in its place fails here (issue 57)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vllm_xpu_memfix.startup.inputs import Inputs

DOCTOR_MD = Path(__file__).parents[1] / "docs" / "doctor.md"

# Each field of Inputs, and the row of the table that says where it comes from.
ROW_OF = {
    "tp": "layout",
    "pp": "layout",
    "ranks_here": "layout",
    "engines_here": "layout",
    "ranks_placed": "layout",
    "expert_ranks": "layout",
    "stage_share": "weights' size",
    "expert_share": "weights' size",
    "other_weight_bytes": "weights' size",
    "linear_params": "weights' size",
    "shard_16bit": "weights' size",
    "linear_bytes_per_weight": "weights' format",
    "prequantized": "weights' format",
    "int4_layouts": "sym_int4 layouts",
    "on_the_fly": "staging",
    "unit_params": "staging",
    "legacy_load": "staging",
    "load_mode_why": "staging",
    "staging_slots": "staging",
    "cpu_offload_bytes": "CPU offload",
    "utilization": "device memory",
    "device_bytes": "device memory",
    "kv_cache_bytes": "KV cache",
    "kv_layout": "KV cache",
    "kv_per_token": "KV cache",
    "kv_cache_dtype": "KV cache",
    "kv_element_bytes": "KV cache",
    "activation_bytes": "activations",
    "burst": "sampler burst",
    "kv_headroom": "plugin",
    "kv_headroom_slack": "plugin",
    "plugin": "plugin",
    "max_model_len": "context",
    "max_model_len_fitted": "context",
    "model_max_len": "context",
    "attention_heads": "vLLM release, platform",
    "refusals": "vLLM release, platform",
    "checked_tp": "vLLM release, platform",
    "not_modelled": "flags not modelled",
    "gpus_in_context": "GPUs in one context",
    "battlemage_in_context": "GPUs in one context",
    "runtime": "driver, kernel",
    "kernel": "driver, kernel",
    "defer_backing_off": "peer access",
    "peer_access_off": "peer access",
    "p2p": "peer access",
    "baseline": "process baseline",
    "room": "host memory",
    "swap": "host memory",
}
HEADER = "| input | read from | given by | unknown: assumed | settled by |"


def _rows() -> dict[str, list[str]]:
    lines = DOCTOR_MD.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_every_input_of_the_model_has_its_row():
    fields = {f.name for f in dataclasses.fields(Inputs)}
    assert fields - set(ROW_OF) == set(), "an input with no row in docs/doctor.md"
    assert set(ROW_OF) - fields == set(), "a row's input the model no longer has"
    rows = _rows()
    assert set(ROW_OF.values()) - set(rows) == set()


def test_each_row_says_what_is_assumed_and_a_ranged_input_its_range():
    rows = _rows()
    for row, (_read, _given, assumed, _settled) in rows.items():
        assert assumed, row
    ranged = [f.name for f in dataclasses.fields(Inputs) if "Known" in str(f.type)]
    assert "linear_bytes_per_weight" in ranged
    for name in ranged:
        assert " to " in rows[ROW_OF[name]][2], (name, "its range is not stated")
