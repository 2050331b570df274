"""The one redactor of text a user may paste into a public issue (``report``).

Whatever a field holds (a variable's value, a serve line, a ledger row, a file name), it
leaves here without credentials in URLs, values of secret-looking command-line options,
Hugging Face tokens, the values of this environment's secret-named variables, IPv4 and
IPv6 addresses (loopback and the unspecified address kept: they name no machine), host
names (this host's, and any the caller learned from ledger rows and file names) and home
directories (whole path components: ``/home/alice`` never leaves part of
``/home/alice2``; POSIX and Windows). Text that is not valid UTF-8 (``surrogateescape``
from the environment) is made printable first, so nothing here raises on it.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping

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
# An option with one of these as a word of its name: --api-key, --hf-token, not --tokenizer
# or --max-num-batched-tokens.
_SECRET_OPTION = re.compile(
    r"(--?(?:\w+-)*(?:key|token|secret|password|passwd|credentials?|auth|cookie)(?:-\w+)*)"
    r"(=|\s+)(\S+)",
    re.I,
)
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_BARE_CREDENTIALS = re.compile(r"(?<![\w/])[\w.%+-]+:[^\s/@:]+@(?=[\w\[])")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{6,}")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
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
            if len(name) >= 2 and name.lower() != "localhost":
                # A name's neighbours may be hyphens: ledger-<host>-<pid>.jsonl.
                pattern = rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])"
                text = re.sub(pattern, HOST, text, flags=re.I)
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
    """``text`` without ``secrets`` (:func:`secret_values`), URL credentials, the values of
    secret-looking options (``--api-key``, ``--hf-token``) and Hugging Face tokens: what the
    ledger may keep of a command line. Addresses, host names and homes stay."""
    for value in secrets:
        text = text.replace(value, HIDDEN)
    text = _URL_CREDENTIALS.sub(rf"\1{HIDDEN}@", text)
    text = _BARE_CREDENTIALS.sub(f"{HIDDEN}@", text)
    text = _SECRET_OPTION.sub(rf"\1\2{HIDDEN}", text)
    return _HF_TOKEN.sub(HIDDEN, text)


def _worth_hiding(value: str) -> bool:
    """A value that could be a secret: not a switch, a number or a one-letter word."""
    plain = value.strip().lower()
    return len(plain) >= 6 and plain not in {"false", "true"} and not plain.isdigit()


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
