"""Start-up cost of the preflight: vLLM's ``EngineArgs.create_engine_config`` timed with the
preflight installed (``VLLM_XPU_MEMFIX_PREFLIGHT=auto``) and without it (``off``), in one
process, alternating, median of ``--rounds`` runs each (after one warm-up call of each).

Two cases: the tiny model of the demo on this host (no Intel GPU: the device is not
judged), and a sparse 27B BF16 checkpoint (18 shards of safetensors headers) on a sysroot
that describes one 32 GiB Arc Pro B70 (the verdict and the remedies are computed).
Writes ``benchmarks/results/preflight.md``. Target: under 200 ms added."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _b70_27b(tmp: Path) -> tuple[Path, Path]:
    from hosts import B70, build_host, qwen_27b_like

    host = build_host(tmp / "host", [B70])
    model = qwen_27b_like(tmp / "model27b")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 248320,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096,
    }
    (model / "config.json").write_text(json.dumps(config))
    return host, model


def _time_once(model: Path, installed: bool, env: dict[str, str]) -> float:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.core.patching import Patcher
    from vllm_xpu_memfix.fixes import preflight

    patcher = Patcher()
    env = {**env, "VLLM_XPU_MEMFIX_PREFLIGHT": "auto"}
    if installed:
        preflight.install(patcher, config.load(env))
    try:
        args = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True)
        started = time.perf_counter()
        args.create_engine_config()
        return time.perf_counter() - started
    finally:
        patcher.revert_all()


def measure(model: Path, env: dict[str, str], rounds: int) -> dict[str, float]:
    times: dict[bool, list[float]] = {True: [], False: []}
    _time_once(model, True, env)
    _time_once(model, False, env)
    for index in range(rounds):
        for installed in (True, False) if index % 2 == 0 else (False, True):
            times[installed].append(_time_once(model, installed, env))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"on_ms": on * 1e3, "off_ms": off * 1e3, "added_ms": (on - off) * 1e3, "ratio": on / off}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM loads the plugin inside create_engine_config: its own preflight stays off, so
    # only the one this script installs (or not) acts.
    os.environ["VLLM_XPU_MEMFIX_PREFLIGHT"] = "off"
    os.environ["VLLM_PLUGINS"] = "none"
    import logging

    from vllm_xpu_memfix.cli.demo.tiny_model import make_model

    logging.getLogger("vllm").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = make_model(tmp / "tiny")
        host, big = _b70_27b(tmp)
        cases = [
            ("tiny model, this host (no Intel GPU)", tiny, {}),
            (
                "sparse 27B BF16, sysroot: 1x Arc Pro B70 32 GiB",
                big,
                {"VLLM_XPU_MEMFIX_SYSROOT": str(host)},
            ),
        ]
        for label, model, env in cases:
            os.environ.update(env)
            try:
                result = measure(model, env, args.rounds)
            finally:
                for key in env:
                    os.environ.pop(key, None)
            rows.append((label, result))
            print(label, json.dumps({k: round(v, 2) for k, v in result.items()}), file=sys.stderr)
    out = ROOT / "benchmarks" / "results" / "preflight.md"
    lines = [
        f"# Preflight start-up cost ({datetime.date.today()})",
        "",
        f"`python benchmarks/preflight.py --rounds {args.rounds}`: `create_engine_config` with the "
        "preflight installed (auto) and without it (off), alternating in one process, median of "
        f"{args.rounds} runs each. Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, vLLM CPU build. Target: under 200 ms added.",
        "",
        "| case | off (ms) | auto (ms) | added (ms) | auto / off |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['added_ms']:.1f} | "
            f"{r['ratio']:.2f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
