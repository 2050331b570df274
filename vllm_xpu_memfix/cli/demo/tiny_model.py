"""A random Qwen3 checkpoint and a byte-level BPE tokenizer, made locally.

No model hub is needed: the weights are random and the tokenizer is trained on
a few sentences. Needs ``transformers`` and ``tokenizers``, which every vLLM
install has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "vLLM serves large language models with paged attention.",
    "Intel Arc Pro GPUs run vLLM through the XPU platform.",
    "Host memory, device memory and the page cache are different things.",
    "Hello, how are you today? I am fine, thank you.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; :",
]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    vocab_size: int = 512
    tie_word_embeddings: bool = True


TINY = ModelShape()
# About 134 M parameters, 268 MB in bf16: weight loading stands out of a worker's RSS.
SMALL = ModelShape(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=4096,
    vocab_size=8192,
)
# About 1.04 B parameters, 2.1 GB in bf16: large enough that host-memory effects stand above noise.
ONE_B = ModelShape(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=8192,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 400),
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def make_model(
    directory: str | Path, shape: ModelShape = TINY, seed: int = 0, max_shard_size: str = "1GB"
) -> Path:
    """Write a random bf16 ``Qwen3ForCausalLM`` checkpoint with its tokenizer into ``directory``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(shape.vocab_size)
    tokenizer.save_pretrained(directory)
    config = Qwen3Config(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).bfloat16()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    return directory


def parameter_bytes(directory: str | Path) -> int:
    """Bytes of tensor data in the checkpoint, read from the safetensors headers."""
    from vllm_xpu_memfix.memory.checkpoint import read_checkpoint

    return read_checkpoint(directory).total_bytes
