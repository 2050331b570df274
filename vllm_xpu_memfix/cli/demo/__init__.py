"""The demo: serve a tiny local model with the plugin and show what it did."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from vllm_xpu_memfix.cli.demo.server import Server
from vllm_xpu_memfix.cli.demo.tiny_model import make_model

DEFAULT_WORKDIR = Path("vllm-xpu-memfix-demo")
# What the demo imports: vLLM serves, torch, transformers and tokenizers make the model.
NEEDS = ("vllm", "torch", "transformers", "tokenizers")


_PLUGIN_LINE = re.compile(r"\] vllm-xpu-memfix[ :]")


def plugin_lines(log_text: str) -> list[str]:
    """Lines the plugin logged (its messages start with its name), not others that mention it."""
    return [line for line in log_text.splitlines() if _PLUGIN_LINE.search(line)]


def ledger_report(log_text: str) -> list[str]:
    """The worker's ledger: its table (a record per row) through the likely cause, as logged
    by the process that logged the table's title."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if "host-memory ledger" in line:
            process = line.split(")", 1)[0]
            own = [row for row in lines[i:] if row.split(")", 1)[0] == process]
            end = next((j for j, row in enumerate(own) if "likely cause:" in row), len(own) - 1)
            return own[: end + 1]
    return []


def run_demo(workdir: Path = DEFAULT_WORKDIR, say: Callable[[str], None] = print) -> int:
    from vllm_xpu_memfix.cli import monitor

    workdir.mkdir(parents=True, exist_ok=True)
    say(f"[1/4] making a tiny random Qwen3 model in {workdir / 'model'}")
    model = make_model(workdir / "model")
    log_path = workdir / "server.log"
    csv_path = workdir / "monitor.csv"
    ledger_dir = workdir / "ledger"
    for old in ledger_dir.glob("ledger-*.jsonl"):
        old.unlink()
    say(f"[2/4] starting vLLM's OpenAI server with the plugin (log: {log_path})")
    env = {"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir)}
    stop = threading.Event()
    with Server(model, log_path, env=env) as server:
        assert server.process is not None
        sampler = threading.Thread(
            target=monitor.sample_to_csv,
            args=(server.process.pid, csv_path, lambda: not stop.is_set()),
            daemon=True,
        )
        sampler.start()
        try:
            ready = server.wait_ready(progress=lambda t: say(f"      still starting ({t:.0f} s)"))
            say(f"      ready after {ready:.1f} s; sending one completion")
            text = server.complete("Hello, how are you", max_tokens=8)["choices"][0]["text"]
            say(f"      the model answered {text!r} (random weights)")
        finally:
            stop.set()
            sampler.join()
    log_text = log_path.read_text(encoding="utf-8", errors="replace")
    say("[3/4] what the plugin did, from the server log:")
    for line in plugin_lines(log_text):
        if "host-memory ledger" in line:
            break
        say(f"      {line}")
    for line in ledger_report(log_text):
        say(f"      {line}")
    say(f"[4/4] host memory over time: {csv_path}")
    from vllm_xpu_memfix.cli.plot import PlotError, plot

    try:
        say(f"      picture: {plot(csv_path, workdir / 'host-memory.png', ledger_dir)}")
    except PlotError as exc:
        say(f"      no picture: {exc}")
    return 0


def missing_packages() -> list[str]:
    """Of ``NEEDS``, those this Python cannot import (found without importing them)."""
    absent = []
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken install, or a None in sys.modules
            found = False
        if not found:
            absent.append(name)
    return absent


def main(args: argparse.Namespace) -> int:
    absent = missing_packages()
    if absent:
        print(
            f"vllm-xpu-memfix demo: no {', '.join(absent)} in this Python; run it where vLLM "
            "is installed, or `make demo` in a checkout (it installs vLLM's CPU build)",
            file=sys.stderr,
        )
        return 2
    return run_demo(Path(args.workdir))
