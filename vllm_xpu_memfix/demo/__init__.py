"""The demo: serve a tiny local model with the plugin and show what it did."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from vllm_xpu_memfix.demo.server import Server
from vllm_xpu_memfix.demo.tiny_model import make_model

PLUGIN_LINE = re.compile(r"vllm-xpu-memfix")


def plugin_lines(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if PLUGIN_LINE.search(line)]


def run_demo(workdir: Path | None = None, say: Callable[[str], None] = print) -> int:
    with tempfile.TemporaryDirectory(prefix="vllm-xpu-memfix-demo-") as tmp:
        base = workdir or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        say(f"[1/3] making a tiny random Qwen3 model in {base / 'model'}")
        model = make_model(base / "model")
        log_path = base / "server.log"
        say(f"[2/3] starting vLLM's OpenAI server with the plugin (log: {log_path})")
        with Server(model, log_path) as server:
            ready = server.wait_ready()
            say(f"      ready after {ready:.1f} s; sending one completion")
            text = server.complete("Hello, how are you", max_tokens=8)["choices"][0]["text"]
            say(f"      the model answered {text!r} (random weights)")
        say("[3/3] what the plugin did, from the server log:")
        for line in plugin_lines(log_path.read_text(encoding="utf-8", errors="replace")):
            say(f"      {line}")
    return 0
