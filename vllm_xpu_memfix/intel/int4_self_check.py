"""device_quant's self-check: the plugin's Q4_0 kernel against the installed ``sym_int4``'s
own host quantizer, in the process that is about to use it, and its record for ``check``.

The host side is the module's ``ggml_quantize_tensor``, called as its per-layer function
calls it (fp32, ``block_size``, ``transpose=False``), so whatever library and argument
list the installed build has, that is what the kernel is held to. Two probes: a random
tensor, and the near-tie probe (``kernels.q4_0_probe``), where a library that rounds
``x * id + 8.5`` in another order differs in most words. Any differing word or scale
bit keeps the host path for the run.

The outcome is written, one JSON object, to ``device-quant-self-check.json`` in the
plugin's lock directory, where ``check`` and ``doctor`` read the latest one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core.host_lock import prepare_lock_dir

RECORD = "device-quant-self-check.json"
RANDOM_SHAPE = (64, 512)
LIBRARY_VARIABLE = "VLLM_QUANTIZE_Q40_LIB"
HOST_FUNCTION = "ggml_quantize_tensor"


class SelfCheckFailed(RuntimeError):
    def __init__(self, what: str, exc: Exception) -> None:
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Comparison:
    probe: str
    words: int
    words_differ: int
    scales_differ: int

    @property
    def identical(self) -> bool:
        return self.words_differ == 0 and self.scales_differ == 0

    def summary(self) -> str:
        scales = f", {self.scales_differ} scale(s)" if self.scales_differ else ""
        return f"{self.words_differ:,} of {self.words:,} words{scales} ({self.probe})"


def library_of(module: Any) -> str:
    """The module's host quantizer and the C library it loads, with a short hash."""
    path = getattr(module, LIBRARY_VARIABLE, None) or os.environ.get(LIBRARY_VARIABLE)
    if not path:
        return f"sym_int4.{HOST_FUNCTION} (its library's path not named)"
    try:
        digest = f"sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]}"
    except OSError:
        digest = "unreadable here"
    return f"sym_int4.{HOST_FUNCTION} ({path}, {digest})"


def probes(group: int) -> list[tuple[str, Any]]:
    import torch

    from vllm_xpu_memfix.kernels.q4_0_probe import near_tie_probe

    n, k = RANDOM_SHAPE
    generator = torch.Generator().manual_seed(20261202)
    random = (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)
    ties = near_tie_probe(group, torch.bfloat16)
    return [
        (f"random {n}x{k} bf16", random),
        (f"near-tie probe {ties.shape[0]}x{ties.shape[1]} bf16", ties),
    ]


def compare(
    module: Any, device: Any, probe: str, weight: Any, group: int, library: str
) -> Comparison:
    """One probe through the module's host quantizer (``library`` names it) and the kernel."""
    import torch

    from vllm_xpu_memfix.kernels import quantize_q4_0

    n, k = weight.shape
    qweight = torch.zeros((n, k // 8), dtype=torch.int32)
    scales = torch.zeros((n, k // group), dtype=torch.float16)
    try:
        host_q, host_s = getattr(module, HOST_FUNCTION)(
            weight.float().contiguous(), qweight, scales, n, k, block_size=group, transpose=False
        )
    except Exception as exc:  # the C library is loaded lazily and may be missing
        raise SelfCheckFailed(f"{library} failed on the {probe}", exc) from exc
    try:
        device_q, device_s = (t.cpu() for t in quantize_q4_0(weight.to(device), group))
    except Exception as exc:
        raise SelfCheckFailed(f"the device kernel failed on the {probe}", exc) from exc
    return Comparison(
        probe,
        host_q.numel(),
        int((host_q != device_q).sum()),
        int((host_s.view(torch.int16) != device_s.view(torch.int16)).sum()),
    )


@dataclass(frozen=True)
class SelfCheck:
    """The comparisons made on ``device`` against ``library``, and why the kernel cannot
    be trusted (None: identical)."""

    device: Any
    library: str
    comparisons: list[Comparison]
    problem: str | None

    @property
    def passed(self) -> bool:
        return self.problem is None

    @property
    def why(self) -> str:
        if self.problem is not None:
            return self.problem
        checked = " and ".join(f"{c.words:,} words of a {c.probe}" for c in self.comparisons)
        return f"self-check on {self.device} matched {self.library} bit for bit on {checked}"

    def record(self) -> dict[str, Any]:
        return {
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "pid": os.getpid(),
            "device": str(self.device),
            "library": self.library,
            "comparisons": [asdict(c) for c in self.comparisons],
            "device_path": self.passed,
            "why": self.why,
        }


def run(module: Any, device: Any) -> SelfCheck:
    group = int(getattr(module, "QK4_GROUP_SIZE", 128))
    library = library_of(module)  # hashes the library file once
    done: list[Comparison] = []
    for probe, weight in probes(group):
        try:
            done.append(compare(module, device, probe, weight, group, library))
        except SelfCheckFailed as failed:
            return SelfCheck(device, library, done, str(failed))
    if all(c.identical for c in done):
        return SelfCheck(device, library, done, None)
    found = "; ".join(c.summary() for c in done)
    return SelfCheck(
        device,
        library,
        done,
        f"the device kernel differs from {library} in {found}: they round x * id + 8.5 differently",
    )


def write_record(directory: Path, record: dict[str, Any]) -> None:
    """Replace the record atomically in the plugin's lock directory, held to the same
    rules as for its locks; ranks of one start may write at once."""
    handle, temporary = tempfile.mkstemp(dir=prepare_lock_dir(directory), prefix=".self-check-")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(record, out)
        os.replace(temporary, directory / RECORD)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def describe(directory: Path) -> str:
    """What the self-check compares, and its last recorded outcome, for ``check``."""
    what = (
        f"each process that loads sym_int4 compares the Triton kernel with the module's "
        f"{HOST_FUNCTION} on a random tensor and a near-tie probe"
    )
    try:
        last = json.loads((directory / RECORD).read_text())
        outcome = "device path" if last["device_path"] else "host path kept"
        return (
            f"{what}; last run {last['time']} (pid {last['pid']}, {last['device']}): "
            f"{outcome}: {last['why']}"
        )
    except FileNotFoundError:
        return f"{what}; none recorded yet in {directory}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{what}; the record in {directory} is unreadable ({type(exc).__name__})"
