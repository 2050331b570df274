"""Start-up cost of the preflight: vLLM's ``EngineArgs.create_engine_config`` timed with the
preflight installed (``VLLM_XPU_MEMFIX_PREFLIGHT=auto``) and without it (``off``), in one
process, alternating, median of ``--rounds`` runs each (after one warm-up call of each).

Cases: the tiny model of the demo on this host (vLLM's CPU backend: weights and KV cache
against the room); and a sparse 27B BF16 checkpoint (18 shards of safetensors headers)
judged as under vLLM's XPU platform (the test bed has none: the platform is taken for
XPU, as the tests do) on sysroots that describe one 32 GiB Arc Pro B70 (the verdict and
the remedies are computed), 1,000 B70s (TP 8: every card's sysfs files read), and one B70
with a 64 MiB dpkg status (the largest file the reader takes). Writes
``benchmarks/results/preflight.md``. Target: under 200 ms added."""

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
DPKG_BYTES = 64 * 2**20


def _hosts(tmp: Path) -> dict[str, Path]:
    """One B70; 1,000 B70s; one B70 with a dpkg status padded to 64 MiB."""
    from hosts import B70, build_host

    hosts = {
        "one": build_host(tmp / "one", [B70]),
        "thousand": build_host(tmp / "thousand", [B70] * 1000),
        "dpkg": build_host(tmp / "dpkg", [B70]),
    }
    status = hosts["dpkg"] / "var/lib/dpkg/status"
    stanza = "\nPackage: filler-{}\nStatus: install ok installed\nVersion: 1.0-1\n"
    with status.open("a") as out:
        index = 0
        while status.stat().st_size < DPKG_BYTES - 100:
            out.write(stanza.format(index))
            index += 1
            if index % 10_000 == 0:
                out.flush()
    with status.open("r+") as out:
        out.truncate(DPKG_BYTES - 1)
        out.seek(0, 2)
        out.write("\n")
    return hosts


def _b70_27b(tmp: Path) -> Path:
    from hosts import qwen_27b_like

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
    return model


def _time_once(model: Path, installed: bool, env: dict[str, str], tp: int = 1) -> float:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.core.patching import Patcher
    from vllm_xpu_memfix.fixes import preflight

    patcher = Patcher()
    env = {**env, "VLLM_XPU_MEMFIX_PREFLIGHT": "auto"}
    if installed:
        preflight.install(patcher, config.load(env))
    try:
        args = EngineArgs(model=str(model), skip_tokenizer_init=True, tensor_parallel_size=tp)
        started = time.perf_counter()
        args.create_engine_config()
        return time.perf_counter() - started
    finally:
        patcher.revert_all()


def measure(model: Path, env: dict[str, str], rounds: int, tp: int) -> dict[str, float]:
    times: dict[bool, list[float]] = {True: [], False: []}
    _time_once(model, True, env, tp)
    _time_once(model, False, env, tp)
    for index in range(rounds):
        for installed in (True, False) if index % 2 == 0 else (False, True):
            times[installed].append(_time_once(model, installed, env, tp))
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
    from vllm_xpu_memfix.fixes import preflight

    platform_of = preflight.platform_of

    logging.getLogger("vllm").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = make_model(tmp / "tiny")
        big, hosts = _b70_27b(tmp), _hosts(tmp)
        cases = [
            ("tiny model, this host (vLLM's CPU backend)", tiny, None, 1),
            ("sparse 27B BF16, sysroot: 1x Arc Pro B70 32 GiB", big, hosts["one"], 1),
            ("sparse 27B BF16, TP 8, sysroot: 1,000x Arc Pro B70", big, hosts["thousand"], 8),
            ("sparse 27B BF16, sysroot: 1x B70, 64 MiB dpkg status", big, hosts["dpkg"], 1),
        ]
        for label, model, host, tp in cases:
            env = {} if host is None else {"VLLM_XPU_MEMFIX_SYSROOT": str(host)}
            os.environ.update(env)
            # The sysroot cases are judged as vLLM's XPU platform would have them judged.
            preflight.platform_of = platform_of if host is None else (lambda _c: "xpu")
            try:
                result = measure(model, env, args.rounds, tp)
            finally:
                preflight.platform_of = platform_of
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
