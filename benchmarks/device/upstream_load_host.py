"""Host memory of vLLM's own weight readers, with the upstream series applied: what 0001,
0002 and 0005 act on, measured below vLLM's engine (which needs compiled kernels).

Run with the patched vLLM tree first on PYTHONPATH (vLLM's Python only):

    python upstream_load_host.py make DIR GIB        # random bf16 tensors: one pytorch_model.bin
                                                     # and the same as model.safetensors
    python upstream_load_host.py ranks DIR FORMAT DEVICE SLOTS N   # N "ranks" read at once

``ranks`` starts N processes that each read every tensor with vLLM's
``pt_weights_iterator`` (``bin``: ``torch.load`` of the whole file, as every TP rank does)
or ``safetensors_weights_iterator`` (``st``) and copy it to DEVICE, inside
``node_local_slot`` (0001) when SLOTS < N; then ``gc.collect()`` and ``trim_host_heap()``
(0002). The parent samples each child's RssAnon every 20 ms. One JSON line: per-rank peak
and summed peak of RssAnon above each child's start, RssAnon after the read and after the
trim, the trim's time, the allocator (glibc, or tcmalloc when LD_PRELOAD names it), and
the checkpoint's page-cache residency before and after ``drop_checkpoint_cache`` (0005).
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def rss_anon(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_fraction(path: Path) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    vector = (ctypes.c_ubyte * pages)()
    libc.mincore(addr, size, vector)
    libc.munmap(addr, size)
    return sum(b & 1 for b in vector) / pages


def make(directory: Path, gib: float) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tensors, total, index = {}, 0, 0
    while total < gib * 1024 * MiB:  # a mix of matrix and vector sizes, as a model has
        shape = (4096, 4096) if index % 4 else (4096,)
        tensors[f"layers.{index}.weight"] = torch.randn(shape).to(torch.bfloat16)
        total += tensors[f"layers.{index}.weight"].nbytes
        index += 1
    torch.save(tensors, directory / "pytorch_model.bin")
    save_file(tensors, str(directory / "model.safetensors"))
    os.sync()


def child(directory: Path, fmt: str, device: str, slots: int, ranks: int) -> None:

    from vllm.model_executor.model_loader.parallel_loading import node_local_slot
    from vllm.model_executor.model_loader.weight_utils import (
        pt_weights_iterator,
        safetensors_weights_iterator,
    )
    from vllm.utils.system_utils import trim_host_heap

    start = rss_anon()
    files = [str(directory / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors"))]
    reader = pt_weights_iterator if fmt == "bin" else safetensors_weights_iterator
    kept = {}
    waited = time.perf_counter()
    slot = node_local_slot("bench", slots, str(directory)) if slots < ranks else None
    if slot is not None:
        slot.__enter__()
    waited = time.perf_counter() - waited
    for name, tensor in reader(files, False):
        kept[name] = tensor.to(device)
    gc.collect()
    after_read = rss_anon()
    if slot is not None:
        slot.__exit__(None, None, None)
    t0 = time.perf_counter()
    trimmed = trim_host_heap()
    trim_ms = (time.perf_counter() - t0) * 1000
    print(
        json.dumps(
            {
                "start_mib": start / MiB,
                "after_read_mib": (after_read - start) / MiB,
                "after_trim_mib": (rss_anon() - start) / MiB,
                "trim_ms": trim_ms,
                "trimmed": trimmed,
                "waited_s": waited,
                "tensors": len(kept),
            }
        ),
        flush=True,
    )


def ranks(directory: Path, fmt: str, device: str, slots: int, count: int) -> None:
    from vllm.model_executor.model_loader.weight_utils import drop_checkpoint_cache

    path = directory / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    cmd = [sys.executable, __file__, "child", str(directory), fmt, device, str(slots), str(count)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    samples: list[dict[int, int]] = []
    while any(p.poll() is None for p in procs):
        now = {}
        for p in procs:
            try:
                now[p.pid] = rss_anon(p.pid)
            except OSError:
                now[p.pid] = 0
        samples.append(now)
        time.sleep(0.02)  # sampling period, not synchronisation
    children = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs]  # type: ignore[union-attr]
    # Above each child's RssAnon once vLLM was imported, before it read anything.
    start = {p.pid: c["start_mib"] * MiB for p, c in zip(procs, children, strict=True)}
    above = [{pid: max(rss - start[pid], 0) for pid, rss in now.items()} for now in samples]
    peak = {p.pid: max((a[p.pid] for a in above), default=0) for p in procs}
    summed = max((sum(a.values()) for a in above), default=0)
    resident = resident_fraction(path)
    drop_checkpoint_cache(str(directory))
    print(
        json.dumps(
            {
                "format": fmt,
                "device": device,
                "ranks": count,
                "slots": slots,
                "allocator": "tcmalloc"
                if "tcmalloc" in os.environ.get("LD_PRELOAD", "")
                else "glibc",
                "file_mib": path.stat().st_size / MiB,
                "rank_peak_mib": [peak[p.pid] / MiB for p in procs],
                "summed_peak_mib": summed / MiB,
                "children": children,
                "resident_before_drop": resident,
                "resident_after_drop": resident_fraction(path),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    verb, directory = sys.argv[1], Path(sys.argv[2])
    if verb == "make":
        make(directory, float(sys.argv[3]))
    elif verb == "child":
        child(directory, sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        ranks(directory, sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
