"""doctor --host (a machine described in TOML), --write-host, and the pasted serve line:
what is read, what is refused (one line, exit 2, no traceback), and the round trip on this
machine."""
# ruff: noqa: E501  (the tables of bad input read best one case a line)

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.own_parser import COMMAND

from vllm_xpu_memfix.cli.doctor import facts, hostfile, serveline
from vllm_xpu_memfix.startup.sizing import ServeArgs

GiB = 1024**3
B70_HOST = """
[host]
ram_gib = 128
available_gib = 120
swap_gib = 0
kernel = "7.1.8-generic"

[[gpu]]
model = "Arc Pro B70"
count = 4
"""


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_XPU_MEMFIX", "HF_"))
        and k not in ("NEOReadDebugKeys", "EnableDeferBacking")
    }
    return subprocess.run(
        [*COMMAND, "doctor", *args],
        env={**base, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def host_file(tmp_path: Path, text: str, name: str = "host.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def parsed(text: str) -> hostfile.Described:
    import tomllib

    return hostfile.parse(tomllib.loads(text), "h.toml")


# --- reading a host file ---------------------------------------------------------------------


def test_a_host_file_gives_the_machine_and_says_what_was_assumed():
    described = parsed(B70_HOST)
    assert (described.ram, described.available, described.swap) == (128 * GiB, 120 * GiB, 0)
    assert described.kernel is not None and described.kernel.version == (7, 1)
    (kind,) = described.gpus
    assert (kind.name, kind.device_id, kind.count, kind.memory_bytes) == (
        "Arc Pro B70",
        0xE223,
        4,
        32 * GiB,
    )
    assert described.runtime is None and not described.plugin
    assert described.assumed == (
        "[[gpu]] #1: Arc Pro B70 memory 32 GiB",
        "compute-runtime not given: the host copy is taken as possible",
        "judged without the plugin ([plugin] installed = true counts its fixes)",
    )


def test_absent_keys_are_assumed_aloud():
    described = parsed('[host]\nram_gib = 64\n[[gpu]]\npci_id = "0xe211"\n')
    assert described.available == int(64 * GiB - 3.2 * GiB)
    assert described.gpus[0].name == "Arc Pro B60" and described.gpus[0].count == 1
    assert described.swap == 0, "no swap, as the assumption says"
    assert described.assumed[:4] == (
        "available_gib not given: ram_gib less 3.2 GiB for the OS and other processes (5%, "
        "at least 2 GiB)",
        "swap_gib not given: no swap",
        "kernel not given: unknown (with a runtime in compute-runtime #916's range, #916 "
        "is then not ruled out)",
        "[[gpu]] #1: count not given, 1 assumed",
    )


def test_an_image_brings_its_variables_runtime_and_layout_and_the_file_wins():
    described = parsed(
        B70_HOST
        + '[image]\nname = "intel/llm-scaler-vllm:0.21.0-b3.1"\n'
        + '[env]\nVLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT = "0"\n'
    )
    assert described.image is not None and described.image.tag == "0.21.0-b3.1"
    assert described.runtime is not None and described.runtime.release == (26, 14)
    assert "llm-scaler #618" in described.runtime.source
    assert described.env["VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT"] == "0"  # the file's, not the image's
    own = parsed(B70_HOST + '[image]\nname = "0.21.0-b3.1"\n[driver]\ncompute_runtime = "26.27"\n')
    assert own.runtime is not None and own.runtime.release == (26, 27)


def test_an_unknown_model_with_its_memory_is_taken_but_not_for_a_battlemage():
    described = parsed('[[gpu]]\nmodel = "Arc Pro B99"\nmemory_gib = 48\ncount = 2\n')
    assert described.gpus[0].memory_bytes == 48 * GiB and described.gpus[0].device_id == 0
    assert "[[gpu]] #1: not a model doctor knows, so not taken for a Battlemage GPU" in (
        described.assumed
    )


KNOWN = "Arc Pro B70, Arc Pro B60, Arc Pro B50, Arc B580, Arc B570, Arc A770, Arc A750, "


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[host\nram_gib = 1", "is not TOML (Expected ']' at the end of a table declaration"),
        ("[[gpu]]\nmodel = 'B70'\n[hots]\nram_gib = 1", "'hots': unknown key; accepted tables"),
        ("[host]\nram = 64\n[[gpu]]\nmodel = 'B70'", "[host] 'ram': unknown key; accepted: ram_gib"),
        ("[host]\nram_gib = -5\n[[gpu]]\nmodel = 'B70'", "[host] ram_gib: -5 is not valid; accepted"),
        ("[host]\nram_gib = 1e9\n[[gpu]]\nmodel = 'B70'", "1000000000.0 is not valid; accepted: a"),
        ("[host]\nram_gib = 'lots'\n[[gpu]]\nmodel = 'B70'", "[host] ram_gib: 'lots' is not valid"),
        ("[host]\nram_gib = inf\n[[gpu]]\nmodel = 'B70'", "[host] ram_gib: inf is not valid"),
        ("[host]\nram_gib = 8\navailable_gib = 9\n[[gpu]]\nmodel = 'B70'", "is above ram_gib"),
        ("[host]\nswap_gib = true\n[[gpu]]\nmodel = 'B70'", "[host] swap_gib: 'True' is not valid"),
        ("[[gpu]]\nmodel = 'Arc Pro B99'", f"is not a GPU doctor knows; give memory_gib (and pci_id), or a model: {KNOWN}"),
        ("[[gpu]]\nmodel = 'B70'\ncount = 0", "[[gpu]] #1 count: 0 is not valid; accepted: an integer from 1 to 64"),
        ("[[gpu]]\nmodel = 'B70'\ncount = 10000", "[[gpu]] #1 count: 10000 is not valid"),
        ("[[gpu]]\nmodel = 'B70'\ncount = 2.5", "[[gpu]] #1 count: 2.5 is not valid"),
        ("[[gpu]]\nmodel = 'B70'\nmemory_gib = 0", "[[gpu]] #1 memory_gib: 0 is not valid"),
        ("[[gpu]]\nmodel = 'B70'\nmemory_gib = 4096", "[[gpu]] #1 memory_gib: 4096 is not valid"),
        ("[[gpu]]\nmodel = 'B70'\npci_id = '0xe211'", "0xe211 is not the Arc Pro B70 (0xe223)"),
        ("[[gpu]]\npci_id = 'e2'", "[[gpu]] #1 pci_id: 'e2' is not valid; accepted: a PCI id"),
        ("[[gpu]]\ncount = 2", "[[gpu]] #1: needs model or pci_id"),
        ("[[gpu]]\nmodel = 'B70'\ncount = 40\n[[gpu]]\nmodel = 'B60'\ncount = 40", "more than 64 GPUs"),
        ("[host]\nram_gib = 64", "[[gpu]]: is required: one table per GPU kind"),
        ("gpu = 'B70'", "gpu: accepted: [[gpu]] tables, or gpu = [] for none"),
        ("gpu = []\n[driver]\ncompute_runtime = 'latest'", "[driver] compute_runtime: 'latest' is not a compute-runtime version; accepted: year.week"),
        ("gpu = []\n[driver]\ncompute_runtime = '26.99.1'", "'26.99.1' is not a compute-runtime version"),
        ("gpu = []\n[driver]\ncompute_runtime = 26.14", "[driver] compute_runtime: '26.14' is not valid; accepted: a string"),
        ("gpu = []\n[host]\nkernel = 'linux'", "[host] kernel: 'linux' is not a kernel release"),
        ("gpu = []\n[host]\ncgroup_used_gib = 4", "cgroup_used_gib: given without cgroup_limit_gib"),
        ("gpu = []\n[env]\nNEOReadDebugKeys = [1]", "[env] NEOReadDebugKeys: '[1]': accepted: a string"),
        ("gpu = []\n[env]\n'A B' = '1'", "[env] 'A B': is not a variable name"),
        ("gpu = []\n[plugin]\ninstalled = 'yes'", "[plugin] installed: 'yes': accepted: true, false"),
        ("gpu = []\n[image]\nsym_int4_layouts = 3", "[image] sym_int4_layouts: 3 is not valid"),
        ("gpu = []\n[env]\nVLLM_XPU_MEMFIX_LOAD_LOCK = 'maybe'", "VLLM_XPU_MEMFIX_LOAD_LOCK='maybe' is not valid"),
    ],
)  # fmt: skip
def test_a_bad_host_file_is_one_line_naming_the_key(tmp_path, text, message):
    if "VLLM_XPU_MEMFIX_LOAD_LOCK" in text:
        text += "\n[plugin]\ninstalled = true\n"
    path = host_file(tmp_path, text)
    line = refused(doctor("--host", path))
    assert message in line, line
    if "VLLM_XPU_MEMFIX" not in text:
        assert line.startswith(f"doctor: {path}: "), line


def test_a_host_file_that_is_missing_or_not_text_is_one_line(tmp_path):
    missing = tmp_path / "nope.toml"
    assert refused(doctor("--host", str(missing))) == (f"doctor: {missing}: no such file")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert (
        refused(doctor("--host", str(binary)))
        == f"doctor: {binary}: is not UTF-8 text, so not TOML"
    )


# --- the serve line --------------------------------------------------------------------------


BASE = ServeArgs(model=None)


def test_the_serve_line_models_the_memory_flags_in_both_forms_and_lists_the_unmodelled():
    args = serveline.parse(
        [
            "vllm", "serve", "Qwen/Qwen3.8-27B", "-tp", "4", "--gpu-memory-utilization=0.85",
            "--quantization", "sym_int4", "--dtype", "float16", "--max-model-len", "32k",
            "--max-num-seqs=128", "--max-num-batched-tokens", "4K", "--kv-cache-memory-bytes",
            "20G", "--max-parallel-loading-workers", "2", "--kv-cache-dtype", "fp8",
            "--enforce-eager", "--port", "8020", "--served-model-name=qwen", "--trust-remote-code",
        ],
        BASE,
    )  # fmt: skip
    assert args == ServeArgs(
        model="Qwen/Qwen3.8-27B",
        tensor_parallel_size=4,
        gpu_memory_utilization=0.85,
        quantization="sym_int4",
        dtype="float16",
        max_model_len=32_000,
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=20 * GiB,
        max_parallel_loading_workers=2,
        kv_cache_dtype="fp8",
        not_modelled=("--enforce-eager",),  # the port, the name: no memory effect
    )


def test_the_api_server_module_form_takes_model_from_the_flag():
    line = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "-q", "fp8"]
    args = serveline.parse(line, BASE)
    assert (args.model, args.quantization, args.not_modelled) == ("/m", "fp8", ())
    assert serveline.parse(["/usr/bin/vllm", "serve", "/m"], BASE).model == "/m"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (["vllm", "serve", "--port", "8000"], "the serve line names no model"),
        (["vllm", "serve"], "the serve line names no model"),
        (["llama-server", "-m", "x"], "the line after -- is not a serve command"),
        (["vllm", "serve", "m", "-tp", "zero"], "-tp 'zero' is not valid; accepted values: an integer"),
        (["vllm", "serve", "m", "-tp"], "-tp is missing its value"),
        (["vllm", "serve", "m", "--gpu-memory-utilization", "1.5"], "a number above 0 and at most 1"),
        (["vllm", "serve", "m", "--max-model-len", "lots"], "--max-model-len 'lots' is not valid"),
        (["vllm", "serve", "m", "--model", "n"], "two models: 'm' and --model 'n'"),
    ],
)  # fmt: skip
def test_a_bad_serve_line_is_refused_naming_the_flag(line, message):
    with pytest.raises(serveline.ServeLineError, match=None) as caught:
        serveline.parse(line, BASE)
    assert message in str(caught.value)
    result = doctor("--", *line)
    assert message in refused(result)


def test_doctor_flags_and_the_serve_line_must_agree():
    line = refused(doctor("-tp", "2", "--params", "8B", "--", "vllm", "serve", "m", "-tp", "4"))
    assert line == (
        "doctor: tensor_parallel_size is 2 in doctor's flags but 4 in the serve line; give it "
        "in one place"
    )


# --- judging a described machine -------------------------------------------------------------


def judged(tmp_path: Path, text: str, *line: str, **env: str) -> dict[str, Any]:
    result = doctor("--host", host_file(tmp_path, text), "--json", "--params", "27B", "--", *line)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


SERVE_703 = ("vllm", "serve", "Qwen/Qwen3.8-27B", "-tp", "4", "-q", "sym_int4", "--dtype",
             "float16", "--enforce-eager")  # fmt: skip


def test_a_described_machine_is_judged_without_the_plugin_unless_it_is_installed(tmp_path):
    text = B70_HOST + '[image]\nname = "intel/llm-scaler-vllm:0.26.0-b2"\n'
    without = judged(tmp_path, text, *SERVE_703)
    assert without["verdict"] == "will run out of memory"
    assert without["fails_at"] == {"phase": "kv_cache", "where": "host"}
    assert without["gpus"]["driver_guard"].startswith("sets nothing: the plugin is not installed")
    assert without["remedies"][0]["code"] == "driver_guard"
    first = without["remedies"][0]["what"]
    assert first.startswith(
        "set NEOReadDebugKeys=1 EnableDeferBacking=0 for vllm serve, or install"
    )
    assert without["not_modelled"] == ["--enforce-eager"]
    assert without["machine"].endswith("host.toml")

    with_plugin = judged(tmp_path, text + "[plugin]\ninstalled = true\n", *SERVE_703)
    assert with_plugin["gpus"]["driver_guard"].startswith(
        "sets NEOReadDebugKeys=1 EnableDeferBacking=0"
    )
    assert with_plugin["verdict"] == "fits" and with_plugin["fails_at"] is None
    assert with_plugin["remedies"] == []
    assert with_plugin["total"]["host_need"] == pytest.approx(
        without["remedies"][0]["host_need_after_gib"] * GiB, rel=1e-3
    ), "installing the plugin leaves the need its remedy said it would"

    switched_off = text + '[plugin]\ninstalled = true\n[env]\nVLLM_XPU_MEMFIX_DRIVER_ENV = "off"\n'
    off = judged(tmp_path, switched_off, *SERVE_703)
    assert off["verdict"] == "will run out of memory"
    assert off["remedies"][0]["what"].startswith("VLLM_XPU_MEMFIX_DRIVER_ENV=auto (or on)")


def test_the_text_report_shows_the_machine_phases_causes_and_remedies(tmp_path):
    path = host_file(tmp_path, B70_HOST)
    out = doctor("--host", path, "--params", "27B", "--", *SERVE_703).stdout
    assert f"Host ({path})" in out
    assert "Phases (host: all ranks of the host; device: per rank)" in out
    assert "<- runs out on the host" in out
    assert (
        "  driver_host_copy" in out
        and "Remedies (those that fit first, each group the cheapest first)" in out
    )
    assert "  assumed: judged without the plugin" in out
    assert "Verdict: WILL RUN OUT OF MEMORY (host at kv_cache: " in out


# --- --write-host ----------------------------------------------------------------------------


FIGURES = ("verdict", "fails_at", "phases", "causes", "remedies", "per_rank", "total")


def test_write_host_then_host_gives_the_same_answer_as_plain_doctor(tmp_path):
    written = tmp_path / "this.toml"
    args = ("--params", "8B", "-tp", "1", "--quantization", "sym_int4", "--json")
    plain = json.loads(doctor(*args, "--write-host", str(written)).stdout)
    text = written.read_text()
    assert "[plugin]\ninstalled = true" in text and "[host]\nram_gib = " in text
    again = json.loads(doctor(*args, "--host", str(written)).stdout)
    # The host moves between the two runs: MemAvailable is re-read by plain doctor only.
    plain_now = json.loads(doctor(*args).stdout)
    for key in FIGURES:
        if key == "total":
            keep = ("host_need", "page_cache")
            assert {k: again[key][k] for k in keep} == {k: plain[key][k] for k in keep}
        else:
            assert again[key] == plain[key], key
    assert again["verdict"] == plain_now["verdict"]
    assert again["host"]["room"] == plain["host"]["room"]


def test_write_host_refuses_with_host_and_names_an_unwritable_file(tmp_path):
    path = host_file(tmp_path, B70_HOST)
    assert refused(doctor("--host", path, "--write-host", str(tmp_path / "x.toml"))) == (
        "doctor: --write-host writes this machine: drop --host"
    )
    target = tmp_path / "missing" / "x.toml"
    assert refused(doctor("--write-host", str(target))) == (
        f"doctor: {target}: No such file or directory"
    )


def test_written_values_read_back_exactly():
    """GiB figures are written as Python reprs of bytes / 2**30: exact in binary floating
    point, so the bytes read back are the bytes written."""
    from vllm_xpu_memfix.cli.doctor.described import write_host
    from vllm_xpu_memfix.fixes.driver_env import Decision
    from vllm_xpu_memfix.intel import driver
    from vllm_xpu_memfix.memory.room import Room
    from vllm_xpu_memfix.memory.snapshot import CgroupMemory, Snapshot

    odd = 123_456_789_012
    gpus = [driver.Gpu("card1", 0xE223, "0000:03:00.0", 34_359_738_368)] * 2
    measured = facts.Measurement(
        snap=Snapshot(ts=0, pid=1, mem_total=odd, mem_available=odd - 4096, swap_free=8192),
        gpus=gpus,
        visible=gpus,
        runtime=driver.runtime_from_version("26.14.37833.4-1~24.04", "dpkg"),
        level_zero_loader=None,
        guard=Decision(False, ""),
        device_bytes=34_359_738_368,
        device_source="sysfs",
        ckpt=None,
        model_label="",
        legacy=(False, ""),
        room=Room(odd - 4096, CgroupMemory(usage=10 * 4096, limit=odd // 2)),
        load_slots=None,
        kernel=driver.kernel_from_release("6.14.0-37-generic"),
        environ={"NEOReadDebugKeys": "1", "VLLM_XPU_MEMFIX_LEDGER_DIR": "/x", "HOME": "/root"},
    )
    text = write_host(measured)
    back = parsed(text)
    assert (back.ram, back.available, back.swap) == (odd, odd - 4096, 8192)
    assert (back.cgroup_limit, back.cgroup_used) == (odd // 2, 40960)
    assert back.gpus == (hostfile.GpuKind("Arc Pro B70", 0xE223, 2, 34_359_738_368),)
    assert back.runtime is not None and back.runtime.build == 37833
    assert back.env == {"NEOReadDebugKeys": "1"}, "no path of this machine, nothing unrelated"
    assert back.plugin


def test_a_model_path_on_another_machine_is_sized_from_params():
    got = doctor(
        "--json", "--params", "8B", "--", "vllm", "serve", "/llm/models/Qwen3-8B", "-tp", "1"
    )
    assert got.returncode == 0, got.stderr
    model = json.loads(got.stdout)["model"]
    assert model["model"] == "/llm/models/Qwen3-8B (not on this machine)"
    assert model["checkpoint_bytes"] == 16 * 10**9
    refused(doctor("--", "vllm", "serve", "/llm/models/Qwen3-8B"))  # without --params: refused


def test_without_the_standard_tomllib_the_host_file_is_read_with_tomli(tmp_path):
    """Python 3.10 has no tomllib; the package then reads host files with tomli. Run here
    with tomllib hidden, doctor gives the same answer, bad TOML included."""
    pytest.importorskip("tomli")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['tomllib'] = None  # as on Python 3.10\n"
    )
    path = host_file(tmp_path, B70_HOST)
    with_tomllib = doctor("--host", path, "--params", "27B", "--json")
    with_tomli = doctor("--host", path, "--params", "27B", "--json", PYTHONPATH=str(hide))
    assert with_tomli.returncode == 0, with_tomli.stderr
    assert json.loads(with_tomli.stdout)["phases"] == json.loads(with_tomllib.stdout)["phases"]
    probe = doctor("--host", host_file(tmp_path, "[host\n", "bad.toml"), PYTHONPATH=str(hide))
    assert refused(probe).endswith(
        "bad.toml: is not TOML (Expected ']' at the end of a table declaration (at line 1, "
        "column 6))"
    )
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "from vllm_xpu_memfix.cli.doctor import hostfile as h; print(h.tomllib.__name__)",
        ],
        env={**os.environ, "PYTHONPATH": str(hide)},
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "tomli", check.stderr


def test_the_serve_line_models_the_parallel_layout_offload_and_a_fitted_length():
    args = serveline.parse(
        [
            "vllm", "serve", "/m", "-tp", "2", "-pp", "2", "-dp=4", "-dpl", "2", "--nnodes", "2",
            "-r", "1", "-ep", "--distributed-executor-backend", "mp", "--cpu-offload-gb", "2.5",
            "--max-model-len", "auto", "--enforce-eager",
        ],
        BASE,
    )  # fmt: skip
    assert (args.pipeline_parallel_size, args.data_parallel_size) == (2, 4)
    assert (args.data_parallel_size_local, args.nnodes, args.node_rank) == (2, 2, 1)
    assert args.enable_expert_parallel and args.distributed_executor_backend == "mp"
    assert args.cpu_offload_gb == 2.5
    assert args.max_model_len is None and args.max_model_len_fitted
    assert args.not_modelled == ("--enforce-eager",)
    assert serveline.parse(
        ["vllm", "serve", "/m", "--max-model-len", "-1"], BASE
    ).max_model_len_fitted
    with pytest.raises(serveline.ServeLineError, match="--cpu-offload-gb '-3' is not valid"):
        serveline.parse(["vllm", "serve", "/m", "--cpu-offload-gb", "-3"], BASE)


def test_doctor_takes_max_model_len_auto_as_vllm_does(tmp_path):
    """vLLM 0.32 accepts --max-model-len auto and -1 (human_readable_int_or_auto); so does
    doctor, before and after --, and judges the context as fitted to the KV cache."""
    host = host_file(tmp_path, B70_HOST)
    for args in (
        ("--max-model-len", "auto", "--", "vllm", "serve", "m"),
        ("--", "vllm", "serve", "m", "--max-model-len", "-1"),
    ):
        result = doctor("--host", host, "--json", "--params", "8B", *args)
        assert result.returncode == 0, result.stderr
        assert "fitted to the KV cache" in json.loads(result.stdout)["why"]


def test_a_remedy_that_does_not_fit_says_not_enough():
    """Issue 57 class 8: a remedy after which the start-up still runs out is not shown as
    one that fits."""
    from vllm_xpu_memfix.cli.doctor.render import _remedy_line

    remedy = {"code": "kv_headroom", "what": "w", "cost": "c", "host_need_after_gib": 1.0}
    assert "-> not enough: will run out of memory," in _remedy_line(
        {**remedy, "verdict_after": "will run out of memory"}
    )
    assert "-> fits," in _remedy_line({**remedy, "verdict_after": "fits"})
