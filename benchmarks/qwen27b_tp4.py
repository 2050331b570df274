"""The Qwen3.5-27B-like layer shapes at TP 4 that the device benchmarks quantize.

Hidden 5120, MLP 17408, Gated DeltaNet 16/48 heads of 128, attention 24/4 heads of 256,
each split 4 ways as TP 4 does; 64 layers, three Gated DeltaNet layers to one attention.
"""

GDN = (
    ("gdn in_proj_qkvz", (2 * 16 * 128 + 2 * 48 * 128) // 4, 5120),
    ("gdn out_proj", 5120, 48 * 128 // 4),
)
ATTENTION = (
    ("attn qkv", (2 * 24 * 256 + 2 * 4 * 256) // 4, 5120),
    ("attn o_proj", 5120, 24 * 256 // 4),
)
MLP = (("mlp gate_up", 2 * 17408 // 4, 5120), ("mlp down", 5120, 17408 // 4))
# Each distinct layer once: (name, N, K).
LAYERS = (*MLP, *GDN, *ATTENTION)
