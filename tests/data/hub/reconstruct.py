"""How the reconstructed safetensors headers of this folder were made (see README.md).

Each header is rebuilt from a real config.json (its sizes) and the tensor layout that the
checkpoint's format stores (its names, dtypes and shapes), in safetensors' own order
(the library sorts tensors by dtype alignment, then name) and JSON form; where a real
index names the shards, each tensor is put in the shard the index names. Run from the
repository's root: ``python tests/data/hub/reconstruct.py``; it rewrites the .json.gz
files and prints each file's total next to the real figure it is checked against.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = HERE.parent / "configs"
BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "U8": 1, "F8_E4M3": 1, "I64": 8}
Tensors = dict[str, tuple[str, list[int]]]


def header(tensors: Tensors) -> tuple[dict[str, object], int]:
    order = sorted(tensors, key=lambda n: (-BYTES[tensors[n][0]], n))
    out: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        size = math.prod(shape) * BYTES[dtype]
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return out, offset


def write(name: str, shards: dict[str, Tensors]) -> int:
    headers = {}
    total = 0
    for shard, tensors in shards.items():
        headers[shard], size = header(tensors)
        total += size
    with gzip.open(HERE / f"{name}.headers.json.gz", "wt", compresslevel=9) as f:
        json.dump(headers, f, separators=(",", ":"), sort_keys=False)
    return total


def norm(t: Tensors, name: str, size: int, dtype: str) -> None:
    t[name] = (dtype, [size])


def gpt_oss_20b() -> None:
    """openai/gpt-oss-20b: BF16 attention, router and embeddings; MXFP4 experts as U8
    blocks (16 bytes = 32 values a block) and U8 E8M0 scales, BF16 biases."""
    c = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    h, e, v, d = c["hidden_size"], c["num_local_experts"], c["vocab_size"], c["head_dim"]
    q, kv, inter = (
        c["num_attention_heads"] * d,
        c["num_key_value_heads"] * d,
        c["intermediate_size"],
    )
    t: Tensors = {"model.embed_tokens.weight": ("BF16", [v, h]), "lm_head.weight": ("BF16", [v, h])}
    norm(t, "model.norm.weight", h, "BF16")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norm(t, p + "input_layernorm.weight", h, "BF16")
        norm(t, p + "post_attention_layernorm.weight", h, "BF16")
        for proj, out, inn in (("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
            t[p + f"self_attn.{proj}_proj.weight"] = ("BF16", [out, inn])
            norm(t, p + f"self_attn.{proj}_proj.bias", out, "BF16")
        norm(t, p + "self_attn.sinks", c["num_attention_heads"], "BF16")
        t[p + "mlp.router.weight"] = ("BF16", [e, h])
        norm(t, p + "mlp.router.bias", e, "BF16")
        for proj, out, inn in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            t[p + f"mlp.experts.{proj}_blocks"] = ("U8", [e, out, inn // 32, 16])
            t[p + f"mlp.experts.{proj}_scales"] = ("U8", [e, out, inn // 32])
            t[p + f"mlp.experts.{proj}_bias"] = ("BF16", [e, out])
    index = json.loads((HERE / "gpt-oss-20b.index.json").read_text())
    assert set(index["weight_map"]) == set(t), set(index["weight_map"]) ^ set(t)
    shards: dict[str, Tensors] = {}
    for name, shard in index["weight_map"].items():
        shards.setdefault(shard, {})[name] = t[name]
    total = write("gpt-oss-20b", shards)
    print("gpt-oss-20b", total, "index total_size", index["metadata"]["total_size"])


def llama_like(c: dict, t: Tensors, linear, dtype: str, qk_norm: bool = False) -> None:
    h, v = c["hidden_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c.get("num_key_value_heads", c["num_attention_heads"]) * d
    t["model.embed_tokens.weight"] = (dtype, [v, h])
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = (dtype, [v, h])
    norm(t, "model.norm.weight", h, dtype)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norm(t, p + "input_layernorm.weight", h, dtype)
        norm(t, p + "post_attention_layernorm.weight", h, dtype)
        if qk_norm:
            norm(t, p + "self_attn.q_norm.weight", d, dtype)
            norm(t, p + "self_attn.k_norm.weight", d, dtype)
        for proj, out, inn in (("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
            linear(t, p + f"self_attn.{proj}_proj", out, inn)
        if "moe_intermediate_size" in c:
            m = c["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = (dtype, [c["num_experts"], h])
            for x in range(c["num_experts"]):
                for proj, out, inn in (("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)):
                    linear(t, p + f"mlp.experts.{x}.{proj}", out, inn)
        else:
            i = c["intermediate_size"]
            for proj, out, inn in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                linear(t, p + f"mlp.{proj}", out, inn)


def dense(dtype: str):
    def linear(t: Tensors, p: str, out: int, inn: int) -> None:
        t[p + ".weight"] = (dtype, [out, inn])

    return linear


def awq(t: Tensors, p: str, out: int, inn: int) -> None:
    """AutoAWQ GEMM: 8 int4 a packed int32 along the output, a scale and zero a group."""
    t[p + ".qweight"] = ("I32", [inn, out // 8])
    t[p + ".qzeros"] = ("I32", [inn // 128, out // 8])
    t[p + ".scales"] = ("F16", [inn // 128, out])


def gptq_3bit_no_groups(t: Tensors, p: str, out: int, inn: int) -> None:
    """AutoGPTQ (TheBloke's 2023 files): 3-bit packed along the input, one group
    (group_size -1), the act-order g_idx, and the F16 bias AutoGPTQ's QuantLinear saved."""
    t[p + ".qweight"] = ("I32", [inn // 32 * 3, out])
    t[p + ".qzeros"] = ("I32", [1, out // 32 * 3])
    t[p + ".scales"] = ("F16", [1, out])
    t[p + ".g_idx"] = ("I32", [inn])
    t[p + ".bias"] = ("F16", [out])


def fp8_per_tensor(t: Tensors, p: str, out: int, inn: int) -> None:
    """compressed-tensors float-quantized, strategy tensor: FP8 weights, one F32 weight
    scale and one F32 input scale a linear layer."""
    t[p + ".weight"] = ("F8_E4M3", [out, inn])
    t[p + ".weight_scale"] = ("F32", [1])
    t[p + ".input_scale"] = ("F32", [1])


def single(name: str, config: dict, linear, dtype: str, **kw) -> None:
    t: Tensors = {}
    llama_like(config, t, linear, dtype, **kw)
    print(name, write(name, {"model.safetensors": t}))


def main() -> None:
    gpt_oss_20b()
    load = lambda n: json.loads((CONFIGS / n).read_text())  # noqa: E731
    single("qwen3-32b", load("qwen3-32b.json"), dense("BF16"), "BF16", qk_norm=True)
    single("qwen3-30b-a3b", load("qwen3-30b-a3b.json"), dense("BF16"), "BF16", qk_norm=True)
    single("qwen3-32b-awq", load("qwen3-32b-awq.json"), awq, "F16", qk_norm=True)
    fp8 = load("llama-3.1-8b-instruct-fp8.json")
    single("llama-3.1-8b-instruct-fp8", fp8, fp8_per_tensor, "BF16")
    gptq = json.loads((HERE / "wizard-vicuna-30b-gptq.config.json").read_text())
    t: Tensors = {}
    llama_like(gptq, t, gptq_3bit_no_groups, "F16")
    for layer in range(gptq["num_hidden_layers"]):
        t[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = ("F32", [64])
    total = write("wizard-vicuna-30b-gptq", {"model.safetensors": t})
    blob, _ = header(t)
    raw = json.dumps(blob, separators=(",", ":")).encode()
    size = 8 + len(raw) + (-len(raw) % 8) + total
    print("wizard-vicuna-30b-gptq file", size, "Git LFS pointer size 12924188232")


if __name__ == "__main__":
    main()
