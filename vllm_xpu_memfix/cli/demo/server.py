"""Start, wait for and stop a real vLLM OpenAI server on loopback.

Used by the demo, the integration tests and the benchmarks. The server runs in
its own process group, so stopping it also ends EngineCore and the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# On the CPU build an unset KV size is derived from NUMA-node memory, which is
# not reproducible on small VMs; the demo fixes it (GiB).
CPU_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Its sitecustomize asks Linux for the AMX tile state in every process the server starts:
# vLLM 0.32's CPU build uses AMX without asking and dies of SIGILL on AMX CPUs otherwise.
AMX_SITE = Path(__file__).resolve().parent / "amx_site"


def with_amx_site(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`AMX_SITE` first on ``PYTHONPATH``."""
    path = [str(AMX_SITE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


class ServerError(RuntimeError):
    """The server exited or did not become ready; carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` as a context manager."""

    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        *,
        env: Mapping[str, str | None] | None = None,
        extra_args: Sequence[str] = (),
        max_model_len: int = 512,
        enforce_eager: bool = True,
    ) -> None:
        self.model = str(model)
        self.log_path = Path(log_path)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        merged = {**os.environ, **CPU_DEFAULT_ENV, **(env or {})}
        self.env = with_amx_site({k: v for k, v in merged.items() if v is not None})  # None: unset
        # The vllm-cpu distribution is not named "vllm", so the `vllm` console
        # script cannot read its own version; the module entry point works.
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            *(["--enforce-eager"] if enforce_eager else []),
            *extra_args,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def _fail(self, why: str) -> ServerError:
        tail = "\n".join(self.log_text().splitlines()[-40:])
        return ServerError(f"{why}; last lines of {self.log_path}:\n{tail}")

    def wait_ready(
        self, timeout_s: float = 240.0, progress: Callable[[float], None] | None = None
    ) -> float:
        """Poll ``/health`` until it answers 200; returns seconds since start.

        ``progress(elapsed_s)`` is called about every 10 s while waiting.
        """
        assert self.process is not None, "start() first"
        deadline = self.started_at + timeout_s
        next_progress = self.started_at + 10
        while time.monotonic() < deadline:
            if progress is not None and time.monotonic() >= next_progress:
                progress(time.monotonic() - self.started_at)
                next_progress += 10
            if self.process.poll() is not None:
                raise self._fail(f"server exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return self.ready_after_s
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise self._fail(f"server not ready after {timeout_s:.0f} s")

    def post(self, path: str, payload: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps({"model": self.model, **payload}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def complete(self, prompt: str, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
        """``fields`` go into the request as they are (``temperature=0``, ``logprobs=5``)."""
        return self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **fields})

    def chat(self, content: str, max_tokens: int = 8) -> dict[str, Any]:
        messages = [{"role": "user", "content": content}]
        return self.post("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace_s``."""
        if self.process is not None and self.process.poll() is None:
            pgid = self.process.pid
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
            # Workers may outlive the API server by a moment; take the group down.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
