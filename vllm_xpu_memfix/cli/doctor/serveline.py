"""A ``vllm serve`` command line as users paste it, read into :class:`facts.ServeArgs`.

Takes ``vllm serve MODEL ARGS...`` and ``python -m vllm.entrypoints.openai.api_server
--model MODEL ARGS...``, flags as ``--flag value`` or ``--flag=value``. The flags that
change memory are modelled; those ``startup.domain`` holds not modelled are kept, as given,
in ``not_modelled`` (the preflight names the same from the table); the rest change no memory.

:data:`MODELLED` is also the table of doctor's own serve flags (``cli.build_parser`` adds
one option per field, read by :func:`value_of`), so a flag means the same before and
after ``--``. One flag given two different values is refused, in the line or across it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm_xpu_memfix.cli.doctor.facts import ServeArgs
from vllm_xpu_memfix.core.numbers import Bounds, refusal
from vllm_xpu_memfix.startup import domain


class ServeLineError(ValueError):
    """A serve line doctor cannot read; the message is one line naming the flag."""


RANKS = Bounds(1, 1024, integer=True)
UTILIZATION = Bounds(0, 1, above_minimum=True)
COUNT = Bounds(1, 10**9, integer=True)
BYTES = Bounds(0, 2**50, integer=True)
INDEX = Bounds(0, 1023, integer=True)
OFFLOAD_GIB = Bounds(0, 2**20, unit="GiB")
FITTED = -1  # --max-model-len -1 or auto: vLLM fits the context to the KV cache
# vLLM's human-readable integers (--max-model-len 32k, --kv-cache-memory-bytes 20G):
# lower-case suffixes are decimal, upper-case binary (vllm.utils human_readable_int).
_HUMAN = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT]?)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}

# flag -> (ServeArgs field, kind)
MODELLED: dict[str, tuple[str, str]] = {
    "--tensor-parallel-size": ("tensor_parallel_size", "ranks"),
    "-tp": ("tensor_parallel_size", "ranks"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", "utilization"),
    "--quantization": ("quantization", "quantization"),
    "-q": ("quantization", "quantization"),
    "--dtype": ("dtype", "dtype"),
    "--max-model-len": ("max_model_len", "length"),
    "--max-num-seqs": ("max_num_seqs", "count"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", "human"),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", "bytes"),
    "--max-parallel-loading-workers": ("max_parallel_loading_workers", "ranks"),
    "--kv-cache-dtype": ("kv_cache_dtype", "text"),
    "--model": ("model", "text"),
}
# Modelled flags read from the serve line only (not doctor's own flags).
LINE_ONLY: dict[str, tuple[str, str]] = {
    "--pipeline-parallel-size": ("pipeline_parallel_size", "ranks"),
    "-pp": ("pipeline_parallel_size", "ranks"),
    "--data-parallel-size": ("data_parallel_size", "ranks"),
    "-dp": ("data_parallel_size", "ranks"),
    "--data-parallel-size-local": ("data_parallel_size_local", "ranks"),
    "-dpl": ("data_parallel_size_local", "ranks"),
    "--nnodes": ("nnodes", "ranks"),
    "-n": ("nnodes", "ranks"),
    "--distributed-executor-backend": ("distributed_executor_backend", "text"),
    "--node-rank": ("node_rank", "index"),
    "-r": ("node_rank", "index"),
    "--cpu-offload-gb": ("cpu_offload_gb", "gib"),
}
# Modelled switches: flag -> (field, value).
MODELLED_SWITCHES = {
    "--enable-expert-parallel": ("enable_expert_parallel", True),
    "-ep": ("enable_expert_parallel", True),
    "--no-enable-expert-parallel": ("enable_expert_parallel", False),
}
# The ServeArgs fields the serve flags set, the model aside (doctor takes it as MODEL).
FIELDS = tuple(dict.fromkeys(name for name, _ in MODELLED.values() if name != "model"))
ACCEPTED = {
    "ranks": RANKS.accepted,
    "utilization": UTILIZATION.accepted,
    "count": COUNT.accepted,
    "human": "a whole number, optionally with k, m, g (x1000) or K, M, G (x1024)",
    "length": "auto, -1, or a whole number, optionally with k, m, g (x1000) or K, M, G (x1024)",
    "index": INDEX.accepted,
    "gib": OFFLOAD_GIB.accepted,
    "bytes": "a whole number of bytes, optionally with k, m, g (x1000) or K, M, G (x1024)",
    "text": "a value",
}
# What each field is, for doctor --help.
HELP = {
    "tensor_parallel_size": "ranks of the engine, one per GPU (default: 1)",
    "gpu_memory_utilization": "share of each GPU's memory vLLM may use (default: 0.92)",
    "quantization": "quantization method, as vllm serve takes it (e.g. sym_int4, fp8)",
    "dtype": "weights' dtype (auto, bfloat16, float16, ...; default: the checkpoint's)",
    "max_model_len": "longest sequence (32k = 32000, 32K = 32768; auto or -1: fitted to the KV "
    "cache; default: the model's own)",
    "max_num_seqs": "sequences per batch",
    "max_num_batched_tokens": "tokens per batch",
    "kv_cache_memory_bytes": "KV cache size per GPU in bytes (20G), instead of the utilization",
    "max_parallel_loading_workers": "ranks that load weights at once",
    "kv_cache_dtype": "KV cache dtype (auto, fp8, ...)",
}
# Flags of vllm serve that take no value, so the word after them is not theirs.
SWITCHES = frozenset(
    {
        "--enforce-eager",
        "--trust-remote-code",
        "--enable-auto-tool-choice",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--disable-log-requests",
        "--disable-log-stats",
        "--enable-log-requests",
        "--enable-expert-parallel",
        "--enable-lora",
        "--disable-custom-all-reduce",
        "--enable-reasoning",
        "--headless",
        "--disable-sliding-window",
        "--disable-cascade-attn",
        "--async-scheduling",
    }
)
API_SERVER = "vllm.entrypoints.openai.api_server"
NO_MODEL = "the serve line names no model; accepted: vllm serve MODEL [ARGS...] or --model MODEL"


def _human(text: str) -> int | None:
    match = _HUMAN.fullmatch(text.strip())
    if not match:
        return None
    number, suffix = match.groups()
    scale = _SCALE[suffix.lower()]
    if suffix.isupper():
        scale = 1024 ** " KMGT".index(suffix)
    value = float(number) * scale
    return int(value) if value.is_integer() else None


def _names(kind: str) -> tuple[str, ...] | None:
    from vllm_xpu_memfix.cli.doctor import choices

    return choices.quantization_names() if kind == "quantization" else choices.dtype_names()


def value_of(kind: str, raw: str) -> Any:
    """The value ``raw`` gives a flag of ``kind``; ValueError saying why it is refused."""
    if kind in ("text", "quantization", "dtype"):
        if not raw.strip():
            raise ValueError("has an empty value")
        names = None if kind == "text" else _names(kind)
        if names is not None and raw.strip() not in names:
            raise ValueError(refusal(raw, ", ".join(names)))
        return raw.strip()
    if kind == "length" and raw.strip().lower() in ("auto", "-1"):
        return FITTED
    if kind in ("human", "bytes", "length"):
        number = _human(raw)
        bounds = BYTES if kind == "bytes" else COUNT
        value = None if number is None else bounds.value_of(str(number))
    else:
        bounds_of = {"ranks": RANKS, "utilization": UTILIZATION, "count": COUNT}
        bounds_of.update(index=INDEX, gib=OFFLOAD_GIB)
        value = bounds_of[kind].value_of(raw)
    if value is None:
        raise ValueError(refusal(raw, ACCEPTED[kind]))
    return value


def _value(flag: str, kind: str, raw: str) -> Any:
    try:
        return value_of(kind, raw)
    except ValueError as exc:
        raise ServeLineError(f"{flag} {exc}") from None


def launcher_args(words: list[str]) -> tuple[bool, list[str]]:
    """(whether the line is ``vllm serve``, the arguments after ``vllm serve`` or after
    ``python -m ...api_server``)."""
    if len(words) >= 2 and words[0].rpartition("/")[2] == "vllm" and words[1] == "serve":
        return True, words[2:]
    if "-m" in words:
        i = words.index("-m")
        if i + 1 < len(words) and words[i + 1] == API_SERVER:
            return False, words[i + 2 :]
    shown = " ".join(words[:3])
    raise ServeLineError(
        f"the line after -- is not a serve command ({shown!r}); accepted: vllm serve MODEL "
        f"[ARGS...] or python -m {API_SERVER} --model MODEL [ARGS...]"
    )


def parse(words: Sequence[str], base: ServeArgs) -> ServeArgs:
    """``base`` with what the serve line sets; ServeLineError on a line doctor cannot read."""
    return read(words, base)[0]


def read(words: Sequence[str], base: ServeArgs) -> tuple[ServeArgs, tuple[str, ...]]:
    """:func:`parse`, and the flags it ignored: those ``startup.domain`` does not know."""
    _, args = launcher_args(list(words))
    fields: dict[str, Any] = {}
    other: list[str] = []
    ignored: list[str] = []
    positional: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-") or word == "-":
            positional.append(word)
            i += 1
            continue
        flag, has_value, value = word.partition("=")
        if flag in MODELLED_SWITCHES and not has_value:
            name, on = MODELLED_SWITCHES[flag]
            if fields.get(name, on) != on:
                raise ServeLineError(f"{flag} contradicts an earlier flag; give one")
            fields[name] = on
        elif flag in MODELLED or flag in LINE_ONLY:
            if not has_value:
                if i + 1 >= len(args):
                    raise ServeLineError(f"{flag} is missing its value")
                value, i = args[i + 1], i + 1
            name, kind = MODELLED.get(flag) or LINE_ONLY[flag]
            given = _value(flag, kind, value)
            if name in fields and fields[name] != given:
                raise ServeLineError(
                    f"{flag} is given twice: {fields[name]!r} and {given!r}; give it once"
                )
            fields[name] = given
        else:
            takes_value = (
                not has_value
                and flag not in SWITCHES
                and not flag.startswith("--no-")
                and i + 1 < len(args)
                and not args[i + 1].startswith("-")
            )
            given = f"{word} {args[i + 1]}" if takes_value else word
            if domain.side_of(flag) is not None:
                other.append(given)
            elif domain.field_of(flag) is None:
                ignored.append(given)
            i += 1 if takes_value else 0
        i += 1
    if positional:
        if "model" in fields and fields["model"] != positional[0]:
            raise ServeLineError(
                f"two models: {positional[0]!r} and --model {fields['model']!r}; give one"
            )
        fields["model"] = positional[0]
        other += positional[1:]
    if not fields.get("model"):
        raise ServeLineError(NO_MODEL)
    return replace(base, **fitted(fields), not_modelled=tuple(other)), tuple(ignored)


def fitted(fields: dict[str, Any]) -> dict[str, Any]:
    """``--max-model-len auto`` / ``-1`` as ServeArgs holds it: no length, fitted."""
    if fields.get("max_model_len") == FITTED:
        return {**fields, "max_model_len": None, "max_model_len_fitted": True}
    return fields


def out_of_bounds(namespace: Any) -> dict[str, str]:
    """The modelled values of the line that doctor's own bounds refuse (``-tp 0``), by
    field: why, naming the flag."""
    found = {}
    for flag, (name, kind) in {**MODELLED, **LINE_ONLY}.items():
        value = getattr(namespace, name, None)
        if not flag.startswith("--") or value is None or name in found or kind == "text":
            continue
        try:
            value_of(kind, str(value))
        except ValueError as exc:
            found[name] = f"{flag} {exc}"
    return found
