"""The one redactor of text a user may paste into a public issue (``report``).

Whatever a field holds (a variable's value, a serve line, a ledger row, a file name), it
leaves here without credentials in URLs (``user:password@``, every query value), every
value of a secret-named option (``--api-key k1 k2``, ``--api_key=k``) or JSON key
(``--hf-overrides '{"hf_token": ...}'``) or field (``HF_TOKEN=...``), Authorization,
Bearer and Basic credentials, AWS access key ids, Hugging Face tokens, the values of this
environment's secret-named variables, IPv4 and IPv6 addresses (loopback and the
unspecified address kept: they name no machine; a dotted version or kernel release is no
address), host names (this host's, and any the caller learned from ledger rows and file
names; a name that is a plain word only where it stands as a host) and home
directories (whole path components: ``/home/alice`` never leaves part of
``/home/alice2``; POSIX and Windows). Text that is not valid UTF-8 (``surrogateescape``
from the environment) is made printable first, so nothing here raises on it.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import Iterable, Mapping
from typing import Any

HIDDEN = "<redacted>"
HOST = "<host>"
ADDRESS = "<ip>"
HOME = "<home>"
# Words of a variable's name (split at "_") that mark its value a secret; TOKENIZERS_* and
# NEOReadDebugKeys are not split into such words.
SECRET_WORDS = frozenset(
    {"TOKEN", "TOKENS", "KEY", "KEYS", "APIKEY", "SECRET", "SECRETS", "PASSWORD", "PASSWD"}
    | {"PASS", "CREDENTIAL", "CREDENTIALS", "AUTH", "COOKIE", "SIGNATURE", "PRIVATE"}
)
# The last word of an option's, a JSON key's or a field's name that marks its value a secret
# (--api-key, --api_key, "hf_token", X-Amz-Signature); --return-tokens-as-token-ids and
# --max-num-batched-tokens end in other words. A word run together ("apikey", "accessToken")
# counts by its ending.
_SECRET_LAST_WORDS = frozenset({"key", "keys", "auth", "cookie", "sig", "pass", "pwd"})
_SECRET_ENDINGS: tuple[str, ...] = ("token", "secret", "password", "passwd", "apikey")
_SECRET_ENDINGS += ("credential", "credentials", "signature")
# An option and every value after it up to the next option: vLLM 0.32's --api-key takes a
# list. A value never starts with "-": a bare flag masks nothing after it.
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)(=\S+)?((?:\s+(?!-)\S+)*)")
# "name": "value" (JSON) and 'name': 'value' (a Python dict's repr), and name=value.
_QUOTED_FIELD = re.compile(
    r"""(["'])([\w.-]+)\1(\s*:\s*)(?:(["'])(?:\\.|(?!\4).)*\4|[^\s,{}\[\]"']+)"""
)
_ASSIGNED = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)=([^\s&;,'\"]+)")
_URL_QUERY = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s?#]*\?)([^\s#'\"]*)")
_QUERY_VALUE = re.compile(r"=[^&;]*")
# Authorization header values, Bearer tokens and Basic credentials (base64 of user:password).
_AUTHORIZATION = re.compile(r"(?i)(\bauthorization\s*[:=]\s*)(?:\w+\s+)?[^\s'\"]+")
_BEARER = re.compile(r"\b(Bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_BASIC = re.compile(r"\b(Basic\s+)([A-Za-z0-9+/]{6,}={0,2})(?![\w+/=])")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b")
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_BARE_CREDENTIALS = re.compile(r"(?<![\w/])[\w.%+-]+:[^\s/@:]+@(?=[\w\[])")
# A Hub token by its shape; an all-lowercase word shorter than a real token (34 characters
# after ``hf_``) is an identifier of vLLM or transformers (``hf_config``, ``hf_overrides``).
_HF_TOKEN = re.compile(r"\bhf_(?![a-z]{6,29}(?![A-Za-z0-9]))[A-Za-z0-9]{6,}")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Not a dotted version: a kernel release (5.15.153.1-microsoft-standard-WSL2) or a local
# version (+xpu) goes on after it.
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d|[-+~]\w)")
_IPV6_CANDIDATE = re.compile(
    r"(?<![\w:.])\[?([0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(%\w+)?\]?"
)
_KEEP_ADDRESSES = frozenset({"127.0.0.1", "0.0.0.0", "::1", "::"})
_HOST_OPTION = re.compile(
    r"(--?(?:\w+-)*(?:host|hostname|addr|address|ip)(?:-\w+)*)(=|\s+)(?!-)(\S+)", re.I
)
_OTHER_HOMES = re.compile(r"(?<![\w.~-])/(?:home|Users)/[^/\s\"'`|<>]+")
_WINDOWS_HOMES = re.compile(r"(?i)\b[A-Z]:[\\/]+Users[\\/]+[^\\/\s\"'`|<>]+")
# Where a path component ends: anything but a character of a name.
_END = r"(?![^/\\\s\"'`|<>:;,)\]}])"


def secret_name(name: str) -> bool:
    """Whether a variable's name marks its value a secret (by its words, not its letters)."""
    return bool(SECRET_WORDS & set(re.split(r"[_\W]+", name.upper())))


def secret_key(name: str) -> bool:
    """Whether an option's, a JSON key's or a query field's name marks its value a secret:
    by its last word (``--api-key``, ``--api_key``, ``"hf_token"``, ``X-Amz-Signature``)."""
    last = re.split(r"[-_.]+", name.strip("-_.").lower())[-1]
    return last in _SECRET_LAST_WORDS or last.endswith(_SECRET_ENDINGS)


def printable(text: str) -> str:
    """``text`` with undecodable bytes (surrogates) and control characters made visible."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def this_hosts_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    return names | {name.split(".", 1)[0] for name in names}


class Redactor:
    """``redactor(text)``: the text safe to paste. ``hosts`` adds names to mask, and
    ``show_host`` keeps this host's own name (``report --hostname``)."""

    def __init__(
        self,
        environ: Mapping[str, str],
        hosts: Iterable[str] = (),
        show_host: bool = False,
    ) -> None:
        self.secrets = secret_values(environ)
        self.home = environ.get("HOME", "").rstrip("/\\")
        self.kept = this_hosts_names() if show_host else set()
        self.hosts: set[str] = set()
        self.learn_hosts(set() if show_host else this_hosts_names())
        self.learn_hosts(hosts)

    def learn_hosts(self, names: Iterable[str]) -> None:
        """Mask these host names too (from ledger rows and file names)."""
        for name in names:
            if isinstance(name, str) and len(name) >= 2 and name.lower() != "localhost":
                self.hosts |= {name, name.split(".", 1)[0]} - self.kept

    def __call__(self, text: str) -> str:
        text = without_secrets(printable(text), self.secrets)
        text = self._homes(text)
        text = _HOST_OPTION.sub(_host_option, text)
        text = _IPV4.sub(lambda m: m.group(0) if m.group(0) in _KEEP_ADDRESSES else ADDRESS, text)
        text = _IPV6_CANDIDATE.sub(_ipv6, text)
        for name in sorted(self.hosts, key=len, reverse=True):
            text = re.sub(_host_pattern(name), HOST, text, flags=re.I)
        return text

    def _homes(self, text: str) -> str:
        if len(self.home) > 1:
            text = re.sub(rf"(?<![\w.-]){re.escape(self.home)}{_END}", "~", text)
        text = re.sub(rf"(?<![\w.~-])/root{_END}", "~", text)
        text = _OTHER_HOMES.sub(HOME, text)
        return _WINDOWS_HOMES.sub(HOME, text)


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """The values of the secret-named variables worth hiding, longest first."""
    found = (v for n, v in environ.items() if secret_name(n) and _worth_hiding(v))
    return sorted(found, key=len, reverse=True)


def without_secrets(text: str, secrets: list[str]) -> str:
    """``text`` without ``secrets`` (:func:`secret_values`) and every secret known by its
    name or its shape (the module's list): what the ledger may keep of a command line.
    Addresses, host names and homes stay."""
    for value in secrets:
        text = text.replace(value, HIDDEN)
    text = _URL_CREDENTIALS.sub(rf"\1{HIDDEN}@", text)
    text = _BARE_CREDENTIALS.sub(f"{HIDDEN}@", text)
    text = _URL_QUERY.sub(lambda m: m.group(1) + _QUERY_VALUE.sub(f"={HIDDEN}", m.group(2)), text)
    text = _AUTHORIZATION.sub(rf"\1{HIDDEN}", text)
    text = _BEARER.sub(rf"\1{HIDDEN}", text)
    text = _BASIC.sub(_basic, text)
    text = _AWS_KEY_ID.sub(HIDDEN, text)
    text = _QUOTED_FIELD.sub(_quoted_field, text)
    text = _ASSIGNED.sub(
        lambda m: m.group(1) + ("=" + HIDDEN if secret_key(m.group(1)) else "=" + m.group(2)), text
    )
    text = _OPTION.sub(_option, text)
    return _HF_TOKEN.sub(HIDDEN, text)


def redact_log_records(environ: Mapping[str, str]) -> None:
    """Every log record of this process, and every warning, passes through
    :func:`without_secrets` before any handler sees it: the tools run huggingface_hub and
    vLLM, whose records name URLs as given (huggingface_hub's retry warnings name
    HF_ENDPOINT with its ``user:password@``). Idempotent."""
    global _redacting
    if _redacting:
        return
    _redacting = True
    secrets = secret_values(environ)
    make = logging.getLogRecordFactory()

    def redacted(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        with contextlib.suppress(Exception):  # a record that does not format: logging's
            record.msg, record.args = without_secrets(record.getMessage(), secrets), None
        return record

    logging.setLogRecordFactory(redacted)
    logging.captureWarnings(True)


_redacting = False


def _option(match: re.Match[str]) -> str:
    """A secret option's every value hidden (``--api-key k1 k2``, ``--api_key=k``)."""
    name, first, rest = match.group(1), match.group(2), match.group(3)
    if not secret_key(name) or not (first or rest):
        return match.group(0)
    rest = re.sub(r"(?<=\s)\S+", HIDDEN, rest)
    return name + (f"={HIDDEN}" if first else "") + rest


def _quoted_field(match: re.Match[str]) -> str:
    quote, name, colon = match.group(1), match.group(2), match.group(3)
    if not secret_key(name):
        return match.group(0)
    value_quote = match.group(4) or quote
    return f"{quote}{name}{quote}{colon}{value_quote}{HIDDEN}{value_quote}"


def _basic(match: re.Match[str]) -> str:
    """``Basic <base64 of user:password>``; a word after "Basic" in prose stays."""
    try:
        decoded = base64.b64decode(match.group(2) + "==", validate=False)
    except ValueError:
        return match.group(0)
    return match.group(1) + HIDDEN if b":" in decoded else match.group(0)


def _worth_hiding(value: str) -> bool:
    """A value that could be a secret: not a switch, a number or a one-letter word."""
    plain = value.strip().lower()
    return len(plain) >= 6 and plain not in {"false", "true"} and not plain.isdigit()


def _host_pattern(name: str) -> str:
    """Where ``name`` stands as a host. A name with a digit, a dot or a hyphen
    (``gpu-node-17``) is no word of prose: masked wherever it stands, its neighbours
    perhaps hyphens (``ledger-<host>-<pid>.jsonl``). A name that is a plain word (a host
    called ``ubuntu``) only as a host: after ``://``, ``@``, ``/``, ``-``, ``_`` or ``=``
    (a URL, a file name, a field), before a domain or a port, or as the whole text; never
    in "Ubuntu 24.04.1 LTS"."""
    word = re.escape(name)
    if not name.isalpha():
        return rf"(?<![A-Za-z0-9]){word}(?![A-Za-z0-9])"
    return (
        rf"(?:(?<=[@/=_-]){word}(?![A-Za-z0-9])"
        rf"|(?<![A-Za-z0-9]){word}(?=\.[A-Za-z]|:\d+(?![\d.]))|\A{word}\Z)"
    )


def _ipv6(match: re.Match[str]) -> str:
    try:
        address = ipaddress.IPv6Address(match.group(1))
    except ValueError:
        return match.group(0)
    return match.group(0) if str(address) in _KEEP_ADDRESSES else ADDRESS


def _host_option(match: re.Match[str]) -> str:
    """``--host NAME`` and kin: the name masked, loopback and "all interfaces" kept."""
    value = match.group(3)
    kept = value.lower() in {"localhost", *_KEEP_ADDRESSES} or value.startswith("<")
    return match.group(0) if kept else f"{match.group(1)}{match.group(2)}{HOST}"
