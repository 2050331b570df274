"""The start-up model's domain (issue 45), on real config.json files (tests/data/configs,
with their provenance) and serve lines as users paste them: formats from the checkpoint's
own config, parallel layouts, vLLM's refusals before memory, the KV cache in tokens, CPU
offload and the KV dtype, flags the model does not cover, and remedies that fit the case.
The machine is described (no Intel GPU here): Battlemage cards on kernel 7.1 with the
driver guard applied, as test_startup's ``machine``."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_startup import B60, B70, GiB, machine, two_layouts_on_one_b60

from vllm_xpu_memfix.cli.doctor import serveline
from vllm_xpu_memfix.memory.checkpoint import (
    CheckpointError,
    checkpoint_from_params,
    read_checkpoint,
)
from vllm_xpu_memfix.startup import codes, formats, kv_layout, phases, remedies, resizing, sizing
from vllm_xpu_memfix.startup.known import Source
from vllm_xpu_memfix.vllm_code import releases

CONFIGS = Path(__file__).parent / "data" / "configs"
# Parameters of each checkpoint, from its model card.
PARAMS = {
    "qwen3-32b": 32.8e9,
    "qwen3-32b-awq": 32.8e9,
    "qwen3-30b-a3b": 30.5e9,
    "gpt-oss-20b": 21e9,
    "llama-3.1-8b-instruct-fp8": 8.0e9,
}


def checkpoint(tmp_path: Path, name: str):
    """The real config.json in a model directory, sized by the card's parameter count."""
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    shutil.copy(CONFIGS / f"{name}.json", directory / "config.json")
    return read_checkpoint(directory, int(PARAMS[name]))


def judge(tmp_path, m, name: str, *flags: str) -> phases.Outcome:
    args = serveline.parse(["vllm", "serve", str(tmp_path / name), *flags], sizing.ServeArgs(None))
    return phases.run(sizing.inputs_for(m, args, checkpoint(tmp_path, name)))


def helping(out: phases.Outcome) -> dict[str, remedies.Remedy]:
    return {r.code: r for r in remedies.remedies(out).remedies}


# --- formats from the checkpoint's own config ------------------------------------------------


def test_a_native_mxfp4_checkpoint_is_sized_at_its_bits_and_never_offered_quantize(tmp_path):
    """gpt-oss-20b says quant_method mxfp4: 4.25 bits a weight, not 16 (issue 45 class 1)."""
    out = judge(tmp_path, machine(1, B60), "gpt-oss-20b")
    bf16 = PARAMS["gpt-oss-20b"] * 2
    assert out.inputs.weights == pytest.approx(bf16 / 2 * (0.5 + 1 / 32), rel=0.01)
    assert out.inputs.prequantized and not out.inputs.on_the_fly
    assert out.verdict == codes.FITS
    tight = judge(tmp_path, machine(1, 8 * GiB), "gpt-oss-20b")
    assert tight.verdict == codes.RUNS_OUT
    assert codes.QUANTIZE not in {r.code for r in remedies.remedies(tight).remedies}


@pytest.mark.parametrize(
    ("name", "per_weight"),
    [
        ("qwen3-32b-awq", 0.5 + (2 + 0.5) / 128),  # 4 bits, a 16-bit scale and a zero per 128
        ("llama-3.1-8b-instruct-fp8", 1.0),  # compressed-tensors, config_groups: 8 bits
        ("qwen3-32b", 2.0),
    ],
)
def test_bytes_per_weight_come_from_the_quantization_config(tmp_path, name, per_weight):
    out = judge(tmp_path, machine(2, B70), name, "-tp", "2")
    assert out.inputs.linear_bytes_per_weight.certain
    assert out.inputs.linear_bytes_per_weight.low == pytest.approx(per_weight)
    assert out.inputs.prequantized == (per_weight < 2)


def test_every_method_of_vllms_quantization_registry_is_sized_or_said_unknown():
    registry = pytest.importorskip("vllm.model_executor.layers.quantization")
    sized = {
        method: formats.prequantized_bytes(method, {}) for method in registry.QUANTIZATION_METHODS
    }
    sized |= {m: formats.ON_THE_FLY.get(m) for m in registry.QUANTIZATION_METHODS if not sized[m]}
    known = {m for m, b in sized.items() if b is not None}
    # Sized only from more of their config than the method's name (judged unknown without):
    from_config = {"compressed-tensors", "modelopt", "modelopt_mixed", "quark", "torchao"}
    unsized = {"humming", "fp_quant", "online"}
    assert known | from_config | unsized >= set(registry.QUANTIZATION_METHODS)
    for method in known:
        assert 0.4 < sized[method] <= 1.1, method  # never taken as 16-bit
    assert set(registry.QUANTIZATION_METHODS) >= (releases.xpu_quantization("0.32.0") or {""})


def test_an_unknown_method_is_sized_from_4_bit_to_16_bit(tmp_path):
    """A method the table cannot size (compressed-tensors without its config_groups, which
    XPU serves) is neither sized as 16-bit nor left out: its weights are a range from the
    narrowest format vLLM loads to 16-bit. 32B runs out on 8 GiB even at 4 bits; on a 32 GiB
    B70 it fits at 4 bits and runs out at 16, so it is at risk, naming where it flips (the
    issue-57 case of a 35B GPTQ MoE told "fits" with its weights unsized)."""
    directory = tmp_path / "unsized-model"
    directory.mkdir()
    config = json.loads((CONFIGS / "qwen3-32b.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (directory / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(directory, int(PARAMS["qwen3-32b"]))
    args = sizing.ServeArgs(model=str(directory))
    out = phases.run(sizing.inputs_for(machine(1, 8 * GiB), args, ckpt))
    assert out.verdict == codes.RUNS_OUT and out.fails_at == {"phase": "load", "where": "device"}
    assert out.inputs.prequantized and codes.QUANTIZE not in helping(out)
    per_weight = out.inputs.linear_bytes_per_weight
    assert (per_weight.low, per_weight.high) == (formats.NARROWEST, 2.0)
    assert per_weight.source is Source.ASSUMED
    b70 = phases.run(sizing.inputs_for(machine(1, B70), args, ckpt))
    assert b70.verdict == codes.AT_RISK and codes.DEVICE not in b70.not_judged
    assert "fits if the weights are at most 4-bit; runs out at 16-bit" in b70.why
    assert "compressed-tensors's width is not read" in b70.why


def test_a_method_xpu_does_not_serve_is_vllms_refusal(tmp_path):
    directory = tmp_path / "torchao-model"
    directory.mkdir()
    config = json.loads((CONFIGS / "qwen3-32b.json").read_text())
    config["quantization_config"] = {"quant_method": "torchao", "quant_type": {}}
    (directory / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(directory, int(PARAMS["qwen3-32b"]))
    out = phases.run(sizing.inputs_for(machine(1, B70), sizing.ServeArgs(str(directory)), ckpt))
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.VLLM_REFUSES
    assert "torchao quantization is currently not supported in xpu" in out.why


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, layers: int = 2, hidden: int = 256) -> int:
    """A GGUF v3 file per its spec (llama.cpp docs/gguf.md): metadata, then Q4_K tensors
    (144 bytes per 256 elements) in a 32-byte aligned data section. Returns their bytes."""
    meta = [
        ("general.architecture", 8, gguf_string("llama")),
        ("llama.block_count", 4, struct.pack("<I", layers)),
        ("llama.context_length", 4, struct.pack("<I", 4096)),
        ("llama.embedding_length", 4, struct.pack("<I", hidden)),
        ("llama.attention.head_count", 4, struct.pack("<I", 8)),
        (
            "tokenizer.ggml.tokens",
            9,
            struct.pack("<IQ", 8, 3) + b"".join(gguf_string(t) for t in ("a", "b", "c")),
        ),
    ]
    names = [f"blk.{i}.attn_q.weight" for i in range(layers)]
    size = hidden * hidden // 256 * 144
    header = b"GGUF" + struct.pack("<IQQ", 3, len(names), len(meta))
    for key, kind, value in meta:
        header += gguf_string(key) + struct.pack("<I", kind) + value
    for i, name in enumerate(names):
        header += gguf_string(name) + struct.pack("<IQQIQ", 2, hidden, hidden, 12, i * size)
    header += b"\0" * (-len(header) % 32)
    path.write_bytes(header + b"\0" * (size * len(names)))
    return size * len(names)


def test_a_gguf_file_is_read_from_its_header_and_refused_on_xpu(tmp_path):
    path = tmp_path / "model-Q4_K_M.gguf"
    data = write_gguf(path)
    ckpt = read_checkpoint(path)
    assert ckpt.total_bytes == data and {t.dtype for t in ckpt.tensors} == {"Q4_K"}
    assert ckpt.config["num_hidden_layers"] == 2 and ckpt.config["vocab_size"] == 3
    out = phases.run(sizing.inputs_for(machine(1, B70), sizing.ServeArgs(str(path)), ckpt))
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.VLLM_REFUSES
    assert "gguf quantization is currently not supported in xpu" in out.why
    assert "vllm/platforms/xpu.py" in out.why
    assert remedies.remedies(out).remedies == []


def test_a_file_the_gguf_package_writes_reads_the_same(tmp_path):
    """Where llama.cpp's own gguf package is installed, its writer and this reader agree."""
    gguf = pytest.importorskip("gguf")
    numpy = pytest.importorskip("numpy")
    path = tmp_path / "theirs.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(8192)
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("blk.0.attn_q.weight", numpy.zeros((64, 32), dtype=numpy.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = read_checkpoint(path)
    assert [(t.dtype, t.shape, t.nbytes) for t in ckpt.tensors] == [("F16", (64, 32), 4096)]
    assert (ckpt.config["max_position_embeddings"], ckpt.config["vocab_size"]) == (8192, 4)


@pytest.mark.parametrize(
    ("cut", "message"),
    [(40, "the header ends inside a field at byte 32"),
     (-1, "tensor 'blk.1.attn_q.weight' ends past the end of the file"),
     (0, "not a GGUF file (no GGUF magic)")],
)  # fmt: skip
def test_a_broken_gguf_header_is_refused_in_one_line(tmp_path, cut, message):
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut else b"GGML" + data[4:])
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(path)
    assert str(refused.value) == f"{path}: {message}"


# --- parallel layouts ------------------------------------------------------------------------


def test_pipeline_stages_split_the_layers_and_the_largest_stage_is_judged(tmp_path):
    one = judge(tmp_path, machine(4, B70), "qwen3-32b", "-tp", "2")
    staged = judge(tmp_path, machine(4, B70), "qwen3-32b", "-tp", "2", "-pp", "2")
    assert one.verdict == codes.RUNS_OUT and staged.verdict == codes.FITS
    # 32 of the 64 layers each, the first stage the embedding, the last the (untied) head.
    assert staged.inputs.weights / one.inputs.weights == pytest.approx(0.5)
    assert staged.inputs.host_ranks == 4
    assert staged.inputs.kv_bytes_per_token == pytest.approx(one.inputs.kv_bytes_per_token / 2)


@pytest.mark.parametrize(
    ("flags", "ranks"),
    [(("-tp", "2", "-pp", "2"), "4 ranks (1 engine(s) x TP 2 x PP 2)"),
     (("-tp", "2", "-dp", "2"), "4 ranks (2 engine(s) x TP 2 x PP 1)")],
)  # fmt: skip
def test_every_rank_of_this_node_is_counted_against_its_gpus(tmp_path, flags, ranks):
    out = judge(tmp_path, machine(2, B70), "qwen3-32b", *flags)
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.TP_EXCEEDS_GPUS
    assert out.why == f"{ranks} with 2 GPU(s) visible: vLLM refuses to start"
    fix = helping(out)[codes.TP_FOR_GPUS]
    assert fix.what.startswith("--tensor-parallel-size 1 for the 2 GPU(s) visible")
    assert fix.removes == (codes.TP_EXCEEDS_GPUS,)
    assert codes.MORE_GPUS not in helping(out), "never more GPUs than the case needs"


def test_data_parallel_engines_each_take_the_host_baseline(tmp_path):
    one = judge(tmp_path, machine(4, B70), "qwen3-30b-a3b", "-tp", "2")
    two = judge(tmp_path, machine(4, B70), "qwen3-30b-a3b", "-tp", "2", "-dp", "2")
    assert two.inputs.host_ranks == 2 * one.inputs.host_ranks == 4
    assert two.phases[codes.LOAD].host == pytest.approx(2 * one.phases[codes.LOAD].host)


@pytest.mark.parametrize(
    "flags",
    [
        ("-tp", "4", "--nnodes", "2"),
        ("-tp", "4", "--distributed-executor-backend", "ray"),
        ("-tp", "2", "-dp", "2", "--data-parallel-size-local", "1"),
    ],
)
def test_ranks_on_other_nodes_are_not_this_hosts_gpus(tmp_path, flags):
    """TP 4 over two nodes of 2 GPUs, under Ray, or one of two engines here: not "TP above
    the GPUs" (class 2)."""
    out = judge(tmp_path, machine(2, B70), "qwen3-32b", *flags)
    assert out.verdict != codes.WILL_FAIL
    assert codes.TP_EXCEEDS_GPUS not in {c.code for c in out.causes}


def test_expert_parallel_over_engines_splits_the_experts(tmp_path):
    plain = judge(tmp_path, machine(2, B70), "qwen3-30b-a3b", "-dp", "2")
    ep = judge(tmp_path, machine(2, B70), "qwen3-30b-a3b", "-dp", "2", "--enable-expert-parallel")
    assert 0.9 < ep.inputs.expert_share < 1.0
    assert ep.inputs.weights < 0.6 * plain.inputs.weights


# --- vLLM's refusals before memory -----------------------------------------------------------


def test_tp_that_does_not_divide_the_heads_is_vllms_refusal_not_memory(tmp_path):
    out = judge(tmp_path, machine(4, B70), "qwen3-32b", "-tp", "3")
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.VLLM_REFUSES
    assert "attention heads (64) must be divisible by tensor parallel size (3)" in out.why
    assert "verify_with_parallel_config" in out.why
    fixes = [r for r in remedies.remedies(out).remedies if r.code == codes.TP_FOR_GPUS]
    assert [r.what.split(":")[0] for r in fixes] == [
        "--tensor-parallel-size 4",  # fits on the 4 GPUs
        "--tensor-parallel-size 2",  # removes the refusal; 32.8B in BF16 on 2 B70s runs out
    ]
    assert fixes[0].after.verdict == codes.FITS
    assert fixes[1].removes == (codes.VLLM_REFUSES,)


def test_a_context_above_the_models_is_refused_unless_vllm_is_told_to_allow_it(tmp_path):
    line = ("-tp", "2", "--max-model-len", "64k")
    out = judge(tmp_path, machine(2, B70), "qwen3-32b-awq", *line)
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.VLLM_REFUSES
    assert "above the model's max_position_embeddings 40960" in out.why
    allowed = replace(machine(2, B70), environ={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert judge(tmp_path, allowed, "qwen3-32b-awq", *line).main_cause != codes.VLLM_REFUSES


def test_without_max_model_len_the_models_own_context_is_used(tmp_path):
    assert judge(tmp_path, machine(1, B60), "qwen3-32b-awq").inputs.max_model_len == 40960
    # llama3 RoPE: the length is already scaled, so no factor (as vLLM derives it).
    llama = judge(tmp_path, machine(1, B60), "llama-3.1-8b-instruct-fp8")
    assert llama.inputs.max_model_len == 131072


@pytest.mark.parametrize("value", ["auto", "-1"])
def test_max_model_len_auto_is_fitted_to_the_kv_cache(tmp_path, value):
    out = judge(tmp_path, machine(1, B60), "qwen3-32b-awq", "--max-model-len", value)
    assert out.inputs.max_model_len_fitted and out.inputs.max_model_len is None
    assert out.verdict == codes.FITS
    tokens = out.inputs.kv_tokens
    assert out.why == f"--max-model-len fitted to the KV cache: about {tokens:,} tokens"


# --- the KV cache in tokens, CPU offload, the KV dtype ---------------------------------------


def test_one_sequence_above_the_kv_cache_gets_the_length_that_fits_and_fp8_kv(tmp_path):
    out = judge(tmp_path, machine(1, B60), "llama-3.1-8b-instruct-fp8")
    assert out.verdict == codes.RUNS_OUT and out.main_cause == codes.CONTEXT_EXCEEDS_KV_CACHE
    assert out.fails_at == {"phase": codes.KV_CACHE, "where": codes.DEVICE}
    fixes = helping(out)
    tokens = out.inputs.kv_tokens
    assert fixes[codes.MAX_MODEL_LEN].what == f"--max-model-len {tokens // 16 * 16}"
    assert fixes[codes.KV_CACHE_DTYPE].what == "--kv-cache-dtype fp8"
    for code in (codes.MAX_MODEL_LEN, codes.KV_CACHE_DTYPE):
        assert fixes[code].after.verdict == codes.FITS
    assert out.why.startswith("device at kv_cache")


def test_kv_cache_dtype_fp8_halves_the_bytes_per_token(tmp_path):
    auto = judge(tmp_path, machine(1, B60), "qwen3-32b-awq")
    fp8 = judge(tmp_path, machine(1, B60), "qwen3-32b-awq", "--kv-cache-dtype", "fp8")
    assert fp8.inputs.kv_bytes_per_token == pytest.approx(auto.inputs.kv_bytes_per_token / 2)


def test_cpu_offload_moves_weights_from_each_device_to_the_host(tmp_path):
    line = ("-tp", "2", "-q", "fp8", "--max-model-len", "8k")
    plain = judge(tmp_path, machine(2, B70), "qwen3-32b", *line)
    offload = judge(tmp_path, machine(2, B70), "qwen3-32b", *line, "--cpu-offload-gb", "4")
    assert plain.inputs.weights - offload.inputs.weights == pytest.approx(4 * GiB)
    host = offload.phases[codes.LOAD].host - plain.phases[codes.LOAD].host
    assert host == pytest.approx(2 * 4 * GiB)  # each of the two ranks


# --- flags the model does not cover ----------------------------------------------------------


def test_a_not_modelled_flag_caps_a_failure_only_where_it_could_lower_that_phase(tmp_path):
    """The 32B in fp8 at 40960 tokens overfills one B70 at the KV cache. --enable-lora can
    only add memory there (startup.reach): the failure stands, the flag named;
    --num-gpu-blocks-override can give the KV cache more tokens: at most at risk."""
    line = ("-q", "fp8", "--max-model-len", "40960")
    out = judge(tmp_path, machine(1, B70), "qwen3-32b", *line)
    assert out.verdict == codes.RUNS_OUT and out.fails_at == {
        "phase": codes.KV_CACHE,
        "where": codes.DEVICE,
    }
    lora = judge(tmp_path, machine(1, B70), "qwen3-32b", *line, "--enable-lora")
    assert (lora.verdict, lora.fails_at) == (out.verdict, out.fails_at)
    assert lora.why.endswith("--enable-lora set, which cannot lower the kv_cache phase")
    blocks = ("--num-gpu-blocks-override", "4096")
    override = judge(tmp_path, machine(1, B70), "qwen3-32b", *line, *blocks)
    assert override.verdict == codes.AT_RISK and override.fails_at is None
    assert (
        "not modelled on the device: --num-gpu-blocks-override can lower it, so at most at risk"
        in override.why
    )
    # A host-side flag does not soften the device's verdict.
    shm = judge(tmp_path, machine(1, B70), "qwen3-32b", *line, "--mm-processor-cache-gb", "8")
    assert shm.verdict == codes.RUNS_OUT


# --- remedies that fit the case --------------------------------------------------------------


def test_when_no_one_remedy_fits_the_cheapest_combination_is_given(tmp_path):
    """72B in BF16, -q sym_int4 under the legacy load, on one 24 GB card and a 40 GiB host:
    too big for the card even in int4, staged on a host too small (issue 45 class 4)."""
    m = machine(1, B60, room_gib=40, legacy_load=(True, "the image's legacy load"))
    directory = tmp_path / "big"
    directory.mkdir()
    shutil.copy(CONFIGS / "qwen3-32b.json", directory / "config.json")
    ckpt = read_checkpoint(directory, 72 * 10**9)
    args = serveline.parse(
        ["vllm", "serve", str(directory), "-q", "sym_int4", "--max-model-len", "8192"],
        sizing.ServeArgs(None),
    )
    out = phases.run(sizing.inputs_for(m, args, ckpt))
    assert out.verdict == codes.RUNS_OUT
    found = remedies.remedies(out).remedies
    assert not [r for r in found if codes.JOINED not in r.code and r.after.verdict == codes.FITS]
    (pair,) = [r for r in found if codes.JOINED in r.code]
    assert pair.code == f"{codes.PREQUANTIZED_CHECKPOINT}+{codes.MORE_GPUS}"
    assert pair.after.verdict == codes.FITS and "--tensor-parallel-size 2 on 2 GPUs" in pair.what


def test_more_gpus_only_offers_a_tp_that_divides_the_heads(tmp_path):
    """Qwen3-30B-A3B has 32 heads: every size tried divides them; a 40-head model skips 16."""
    out = judge(tmp_path, machine(1, B60), "qwen3-32b")
    more = helping(out)[codes.MORE_GPUS]
    tp = int(more.what.split()[1])
    assert 64 % tp == 0 and more.after.verdict == codes.FITS
    inputs = phases.Inputs(tp=1, utilization=0.9, device_bytes=B60, attention_heads=40)
    assert resizing.tp_sizes(inputs) == [2, 4, 8]


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}])
def test_the_models_context_and_its_refusal_are_vllms_own(tmp_path, name, rope):
    """The installed vLLM's own derivation (vllm/config/model.py:_get_and_verify_max_len)
    run on the same config.json gives the same length, and refuses the same lengths."""
    pytest.importorskip("vllm.config")
    transformers = pytest.importorskip("transformers")
    from vllm.config.model import _get_and_verify_max_len
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    from vllm_xpu_memfix.startup import context

    config = json.loads((CONFIGS / f"{name}.json").read_text())
    if rope is not None and config.get("rope_scaling") is None:
        config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    convertor = ModelArchConfigConvertorBase(hf, hf.get_text_config())
    arch = SimpleNamespace(derived_max_model_len_and_key=convertor.derive_max_model_len_and_key())
    theirs = _get_and_verify_max_len(hf, arch, None, None, False, None)
    ours = context.model_max_len(config)
    assert ours is not None and ours[0] == theirs
    for asked in (theirs, theirs + 1):
        try:
            _get_and_verify_max_len(hf, arch, None, asked, False, None)
            refused = False
        except ValueError:
            refused = True
        assert bool(context.refusal(asked, config, {})) == refused, asked


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "modelopt", "quantization": "FP8"},
        {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": None}}},
        {"quant_method": "compressed-tensors", "config_groups": ["not", "a", "map"]},
        {"quant_method": "awq", "bits": 4, "group_size": -1},  # bits "4": test_config_sizes
        {"quant_method": "quark", "global_quant_config": [1]},
        {"quant_method": 5},
        "mxfp4",
    ],
)
def test_a_junk_quantization_config_is_judged_without_a_crash(tmp_path, quant):
    directory = tmp_path / "junk"
    directory.mkdir()
    config = json.loads((CONFIGS / "qwen3-32b.json").read_text())
    config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(directory, int(PARAMS["qwen3-32b"]))
    out = phases.run(sizing.inputs_for(machine(1, B70), sizing.ServeArgs(str(directory)), ckpt))
    assert out.verdict in codes.VERDICTS
    inputs = out.inputs
    per_weight = inputs.linear_bytes_per_weight
    sized_16bit = per_weight.certain and per_weight.low == 2.0
    assert not (inputs.prequantized and sized_16bit), "a quantized checkpoint is never 16-bit"


def test_gguf_arrays_nested_past_any_model_are_refused(tmp_path):
    path = tmp_path / "deep.gguf"
    nested = struct.pack("<IQ", 9, 1) * 8 + struct.pack("<IQ", 4, 0)
    meta = gguf_string("x") + struct.pack("<I", 9) + nested
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + meta)
    with pytest.raises(CheckpointError, match="arrays nested deeper than 4"):
        read_checkpoint(path)


def test_a_field_that_cannot_be_compared_is_not_named_and_never_raises():
    from dataclasses import dataclass, field

    class Hostile:
        def __eq__(self, other):
            raise RuntimeError("no comparing")

    @dataclass
    class EngineArgs:
        enforce_eager: bool = False
        compilation_config: object = field(default_factory=Hostile)

    from vllm_xpu_memfix.startup import domain

    assert domain.not_modelled(EngineArgs(enforce_eager=True)) == ("--enforce-eager",)


def test_a_remedy_that_removes_a_listed_cause_is_listed_though_the_verdict_stays():
    """0.21.0-b1's second sym_int4 layout on a model too large either way: the newer image
    removes duplicate_int4_layout, which doctor lists, so it is a remedy (issue 45 class 4)."""
    from vllm_xpu_memfix.intel import catalog

    out = phases.run(two_layouts_on_one_b60(60e9))
    judged = remedies.remedies(out, remedies.Context(image=catalog.image_named("0.21.0-b1")))
    (image,) = [r for r in judged.remedies if r.code == codes.NEWER_IMAGE]
    assert image.after.verdict == out.verdict == codes.RUNS_OUT
    assert image.removes == (codes.DUPLICATE_INT4_LAYOUT,)
    assert codes.NEWER_IMAGE not in {r.code for r in judged.not_helping}


# --- the KV cache's bytes per token where no layout is read (issue 57, item 1) ----------------


def offline(name: str, *flags: str) -> phases.Outcome:
    """A line for a model not at hand: --params sizes it, no config.json is read."""
    args = serveline.parse(["vllm", "serve", f"org/{name}", *flags], sizing.ServeArgs(None))
    ckpt = checkpoint_from_params(int(PARAMS[name]))
    return phases.run(sizing.inputs_for(machine(1, B70), args, ckpt))


def test_without_a_layout_the_kv_bytes_per_token_are_a_range_above_every_real_decoder(tmp_path):
    """The high end is above what each recorded dense config.json keeps a token."""
    for name in ("qwen3-32b", "llama-3.1-8b-instruct-fp8", "gemma-3-1b-it", "qwen3-32b-awq"):
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        read = kv_layout.from_config(config, element=2, state_element=2, batched_tokens=8192)
        params = sizing.params_from_config(config)
        assert read is not None and params
        assert read.per_token(1, 2) < kv_layout.per_token_high(params, 2, 1), name
    kv = offline("llama-3.1-8b-instruct-fp8", "--dtype", "bfloat16").inputs.kv_per_token
    assert kv is not None and kv.low == 0 and kv.source is Source.ASSUMED
    assert "not known" in kv.origin and "go online" in kv.settle


def test_a_long_context_on_an_unread_layout_is_at_risk_naming_the_kv_bytes_per_token(tmp_path):
    """Before: no layout, no check, "fits". The low end (an attention-free model) holds the
    context, the high end does not: at risk, with where it flips and what settles it."""
    line = ("--dtype", "bfloat16", "--max-model-len", "32768")
    out = offline("llama-3.1-8b-instruct-fp8", *line)
    assert out.verdict == codes.AT_RISK and out.main_cause == codes.CONTEXT_EXCEEDS_KV_CACHE
    assert "fits if the KV cache's bytes per token are at most" in out.why
    assert any(
        a.startswith("the KV cache's bytes per token 0 KiB to") for a in phases.ranged(out.inputs)
    )
    fixes = helping(out)
    assert fixes[codes.MAX_MODEL_LEN].after.verdict == codes.FITS
    (fp8,) = [
        i.kv_per_token for code, *_, i in resizing.context(out) if code == codes.KV_CACHE_DTYPE
    ]
    assert fp8 is not None and fp8.high == pytest.approx(out.inputs.kv_per_token.high / 2)
    # A short context fits even at the high end; the recorded config.json settles the long one.
    assert (
        offline(
            "llama-3.1-8b-instruct-fp8", "--dtype", "bfloat16", "--max-model-len", "4096"
        ).verdict
        == codes.FITS
    )
    read = judge(tmp_path, machine(1, B70), "llama-3.1-8b-instruct-fp8", "--max-model-len", "32768")
    assert read.inputs.kv_per_token is None and read.verdict == codes.FITS


def test_a_float32_checkpoint_keeps_a_16_bit_kv_cache_and_activations_under_auto(tmp_path):
    """vLLM's "auto" serves float32 at 16 bits (issue 57, class 6): the KV cache and the
    activations too, not only the weights; --dtype float32 keeps 4 bytes."""
    config = json.loads((CONFIGS / "qwen3-32b.json").read_text())
    (tmp_path / "f32").mkdir()
    (tmp_path / "f32" / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    ckpt = read_checkpoint(tmp_path / "f32", int(PARAMS["qwen3-32b"]))
    bf16 = judge(tmp_path, machine(2, B70), "qwen3-32b", "-tp", "2").inputs
    for dtype, factor in (("auto", 1), ("float32", 2)):
        args = sizing.ServeArgs(None, tensor_parallel_size=2, dtype=dtype)
        f32 = sizing.inputs_for(machine(2, B70), args, ckpt)
        assert f32.kv_bytes_per_token == factor * bf16.kv_bytes_per_token
        assert f32.activation_bytes.high == factor * bf16.activation_bytes.high
