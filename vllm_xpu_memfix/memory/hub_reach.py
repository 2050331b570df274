"""Whether the Hub takes a connection at all, asked once, so that an unreachable one costs a
run about as much as offline.

huggingface_hub answers a failed metadata request for a file not in the cache by asking
again with retries (``_hf_hub_download_to_cache_dir``, then ``http_backoff``: five more
tries, 1 + 2 + 4 + 8 + 8 s apart, huggingface_hub 2.4.0), and vLLM's configuration build
asks for each file it reads: an endpoint refusing connections cost doctor 23 s more than
offline here, each time. One request (``HEAD`` of the endpoint, through huggingface_hub's
own session: its proxies, its certificates) tells: a connection refused, a name that does
not resolve or a connection not taken within :data:`CONNECT_S` is "unreachable"; any answer,
or a connection that then stalls, is reachable (a slow Hub is the deadline's part).
"""

from __future__ import annotations

import os

CONNECT_S = 2.0
# The exception classes of a connection that was never made: httpx's (huggingface_hub 1.x
# and later) and requests' (0.x), by name so that neither need be importable.
_NOT_CONNECTED = {"ConnectError", "ConnectTimeout", "ConnectionError"}


_went_offline: list[str] = []  # why this process went offline, where it did


def _never_connected(exc: BaseException) -> bool:
    return any(kind.__name__ in _NOT_CONNECTED for kind in type(exc).__mro__)


def unreachable() -> str | None:
    """Why the Hub (``HF_ENDPOINT``) takes no connection; None where it does, where
    huggingface_hub is missing or where it is offline already."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=CONNECT_S)
    except Exception as exc:
        if _never_connected(exc):
            return f"the Hub took no connection ({type(exc).__name__})"
    return None


def go_offline(why: str) -> None:
    """huggingface_hub offline for the rest of this process and the processes it starts
    (vLLM inspects a model class in a subprocess): both read ``HF_HUB_OFFLINE``, the
    library once, at its import."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    _went_offline.append(why)


def offline_reason() -> str:
    """Why the Hub is not asked, offline."""
    if _went_offline:
        return f"{_went_offline[0]}, so doctor went offline"
    return "HF_HUB_OFFLINE is set, so the Hub is not asked"
