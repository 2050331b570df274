"""A file's first bytes from the Hub, never more: a streamed range request, closed at the
bytes asked for.

huggingface_hub's own readers take the whole answer into memory
(``HfApi.parse_safetensors_file_metadata`` reads ``response.content``, 2.4.0): a server that
answers a range request with ``200`` and the whole file (a mirror, a proxy) makes them read
every byte of a weight file. Here the answer is streamed through huggingface_hub's session
(its headers, token and redirects) and dropped after ``length`` bytes, whatever the status;
``range_ignored`` says the server sent the whole file instead. An API answer (the model's
file list) is read the same way, refused past its cap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_CONTENT_RANGE = re.compile(r"bytes \d+-\d+/(\d+)")
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Prefix:
    data: bytes  # at most the length asked for
    total: int | None  # the file's size: Content-Range's, else a 200's Content-Length
    range_ignored: bool  # the server answered 200 to the range request


@contextmanager
def _stream(url: str, headers: dict[str, str], timeout: float) -> Iterator[Any]:
    from huggingface_hub.utils import get_session

    session: Any = get_session()
    if hasattr(session, "stream"):  # httpx (huggingface_hub 1.x and later)
        with session.stream("GET", url, headers=headers, timeout=timeout) as response:
            yield response
        return
    response = session.get(url, headers=headers, timeout=timeout, stream=True)  # requests
    try:
        yield response
    finally:
        response.close()


def _chunks(response: Any) -> Iterator[bytes]:
    if hasattr(response, "iter_bytes"):
        return iter(response.iter_bytes(CHUNK))
    return iter(response.iter_content(CHUNK))


def _number(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def prefix(url: str, start: int, length: int, timeout: float) -> Prefix:
    """Bytes ``start`` to ``start + length`` of the file at ``url`` (fewer where it ends)."""
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{start + length - 1}"}
    with _stream(url, headers, timeout) as response:
        hf_raise_for_status(response)
        ranged = response.status_code == 206
        if ranged:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
            total = int(match.group(1)) if match else None
        else:
            total = _number(response.headers.get("Content-Length"))
        skip = 0 if ranged else start  # a 200 starts at the file's first byte
        wanted = skip + length
        got = bytearray()
        for chunk in _chunks(response):
            got += chunk
            if len(got) >= wanted:
                break
    return Prefix(bytes(got[skip:wanted]), total, not ranged)


def json_answer(url: str, cap: int, timeout: float) -> object:
    """The JSON the Hub answers at ``url`` (an API route), refused past ``cap`` bytes."""
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    with _stream(url, build_hf_headers(), timeout) as response:
        hf_raise_for_status(response)
        got = bytearray()
        for chunk in _chunks(response):
            got += chunk
            if len(got) > cap:
                raise ValueError(f"the Hub's answer is above {cap:,} bytes")
    return json.loads(got)
