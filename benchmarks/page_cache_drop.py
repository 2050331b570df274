"""Patch 0005 (``--drop-checkpoint-page-cache``) on a real engine start, in a memory cgroup.

Both arms start vLLM's ``LLM`` on a random Qwen3 of about 300 MB in safetensors shards
(made here), with this plugin off, inside a memory cgroup this script creates (v2
``memory.max`` where the unified hierarchy has the memory controller, else v1
``memory.limit_in_bytes``; it needs root). "as is" runs the installed vLLM; "patched"
runs a copy with the release's variant of patch 0005 applied (``scripts/upstream_check.py``
builds it) and passes ``drop_checkpoint_page_cache=True``. Before each arm the shards
leave the page cache, so the engine's reads are charged to the arm's cgroup.

At ready, the engine process reports: the shards' residency (``mincore``), the cgroup's
usage and its page cache and anonymous memory (``memory.stat``). Then it allocates and
writes a host buffer as large as the shards (what a host-side buffer after load, such as
CPU KV offloading's, asks for) and reports how long that took and how often the cgroup hit
its limit meanwhile (v1 ``memory.failcnt``, v2 ``memory.events``' ``max``). Last, the time
to read the shards again (what a drop costs the next reader: cold after the drop, warm
without it). The limit is the calibration arm's usage at ready plus ``--headroom`` MiB:
the buffer fits beside the engine only if the page cache goes.

    flock /tmp/memfix-heavy.lock timeout 1500 .venv/bin/python benchmarks/page_cache_drop.py \
        --rounds 3 --out benchmarks/results/page-cache-drop-<date>.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import upstream_check

ROOT = upstream_check.ROOT
MiB = 1024**2
PATCH = "0005-"
PLUGIN_OFF = {"VLLM_PLUGINS": "", "VLLM_XPU_MEMFIX": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}

MAKE_MODEL = """
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, num_hidden_layers=6, vocab_size=32000,
    max_position_embeddings=512, tie_word_embeddings=False)
Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size="100MB")
"""

# Runs inside the cgroup: the engine start, then the probes; prints one JSON line.
ENGINE = r"""
import ctypes, json, mmap, os, sys, time
model, cgroup, version, drop = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
shards = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))

def resident():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = pages = 0
    for path in shards:
        size = os.path.getsize(path)
        count = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        with open(path, "rb") as f:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        vector = (ctypes.c_ubyte * count)()
        assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(address, size)
        pages += sum(b & 1 for b in vector)
        total += count
    return 100.0 * pages / total

def read(name):
    with open(os.path.join(cgroup, name)) as f:
        return f.read()

def stat():
    fields = dict(line.split() for line in read("memory.stat").splitlines())
    if version == "2":
        return {"usage": int(read("memory.current")), "cache": int(fields["file"]),
                "anon": int(fields["anon"]), "active_file": int(fields["active_file"]),
                "inactive_file": int(fields["inactive_file"])}
    return {"usage": int(read("memory.usage_in_bytes")), "cache": int(fields["cache"]),
            "anon": int(fields["rss"]), "active_file": int(fields["active_file"]),
            "inactive_file": int(fields["inactive_file"])}

def limit_hits():
    if version == "2":
        return int(dict(l.split() for l in read("memory.events").splitlines())["max"])
    return int(read("memory.failcnt"))

from vllm import LLM
started = time.monotonic()
extra = {"drop_checkpoint_page_cache": True} if drop else {}
llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
          max_num_seqs=4, **extra)
out = {"start_s": time.monotonic() - started, "resident_pct": resident(), **stat()}
size = sum(os.path.getsize(p) for p in shards)
hits = limit_hits()
t0 = time.monotonic()
buffer = bytearray(b"\x01") * size
out["alloc_s"] = time.monotonic() - t0
out["alloc_limit_hits"] = limit_hits() - hits
out["after_alloc"] = stat()
del buffer
t0 = time.monotonic()
for path in shards:
    with open(path, "rb") as f:
        while f.read(16 * 1024 * 1024):
            pass
out["reread_s"] = time.monotonic() - t0
out["shards_mib"] = size / 2**20
print("RESULT " + json.dumps(out), flush=True)
"""


def memory_cgroup() -> tuple[Path, str]:
    """This process's memory cgroup directory and its version ("1" or "2")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "1"
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if "memory" in (root / "cgroup.controllers").read_text(errors="ignore").split():
            return root, "2"
    raise SystemExit("page_cache_drop: no memory cgroup controller here")


def evict(shards: list[Path]) -> None:
    """Drop the shards from the page cache (they are clean: synced after writing)."""
    os.sync()
    for path in shards:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_arm(
    model: Path, parent: Path, version: str, limit: int | None, patched: Path | None
) -> dict:
    group = parent / f"memfix-page-cache-{os.getpid()}"
    group.mkdir()
    try:
        if limit is not None:
            name = "memory.max" if version == "2" else "memory.limit_in_bytes"
            (group / name).write_text(str(limit))
        evict(sorted(model.glob("*.safetensors")))
        env = {**os.environ, **PLUGIN_OFF}
        if patched is not None:
            env["PYTHONPATH"] = str(patched)
        command = [sys.executable, "-c", ENGINE, str(model), str(group), version]
        command.append("1" if patched is not None else "0")
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        found = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not found:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            return {"failed": f"exit {done.returncode}", "tail": tail}
        return json.loads(found[-1][len("RESULT ") :])
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def median(rows: list[dict], key: str, scale: float = 1.0, places: int = 1) -> str:
    values = [r[key] / scale for r in rows if "failed" not in r]
    return f"{statistics.median(values):,.{places}f}" if values else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--headroom", type=int, default=96, help="MiB above calibration")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    parent, version = memory_cgroup()
    installed = upstream_check.installed_vllm_root()
    release = upstream_check.release_version(installed)
    with tempfile.TemporaryDirectory(prefix="page-cache-drop-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([sys.executable, "-c", MAKE_MODEL, str(model)], check=True)
        patch = [p for p in upstream_check.series(release) if p.name.startswith(PATCH)]
        upstream_check.copy_package(installed, work / "patched")
        if len(patch) != 1 or upstream_check.apply(patch[0], work / "patched"):
            raise SystemExit(f"page_cache_drop: patch {PATCH} does not apply to {release}")
        calibration = run_arm(model, parent, version, None, None)
        if "failed" in calibration:
            raise SystemExit(f"page_cache_drop: calibration failed\n{calibration['tail']}")
        limit = calibration["usage"] + args.headroom * MiB
        arms: dict[str, list[dict]] = {"as is": [], "patched, flag on": []}
        for round_ in range(args.rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for arm in order:
                patched = work / "patched" if arm.startswith("patched") else None
                arms[arm].append(run_arm(model, parent, version, limit, patched))
                print(arm, json.dumps(arms[arm][-1]), flush=True)
    lines = [
        f"# Patch 0005 on a real engine start in a memory cgroup ({time.strftime('%Y-%m-%d')})",
        "",
        f"vLLM {release} (installed CPU build) as is against the same with "
        f"`{patch[0].relative_to(ROOT)}` applied and `drop_checkpoint_page_cache=True`; "
        f"plugin off; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"cgroup v{version}, limit {limit / MiB:,.0f} MiB (calibration usage at ready "
        f"{calibration['usage'] / MiB:,.0f} MiB + {args.headroom} MiB); shards "
        f"{calibration['shards_mib']:,.0f} MiB; medians of {args.rounds}; the patch's code diff "
        f"sha256 `{upstream_check.diff_digest(patch[0])}`.",
        "",
        f"`flock /tmp/memfix-heavy.lock .venv/bin/python benchmarks/page_cache_drop.py "
        f"--rounds {args.rounds}`",
        "",
        "| arm | shards resident % | cgroup usage MiB | page cache MiB | anon MiB "
        "| active_file MiB | buffer s | limit hits | usage after buffer MiB "
        "| re-read s | start-up s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, rows in arms.items():
        ok = [r for r in rows if "failed" not in r]
        after = [{"usage": r["after_alloc"]["usage"]} for r in ok]
        lines.append(
            f"| {arm} | {median(rows, 'resident_pct')} | {median(rows, 'usage', MiB)} "
            f"| {median(rows, 'cache', MiB)} | {median(rows, 'anon', MiB)} "
            f"| {median(rows, 'active_file', MiB)} | {median(rows, 'alloc_s', places=3)} "
            f"| {median(rows, 'alloc_limit_hits', places=0)} | {median(after, 'usage', MiB)} "
            f"| {median(rows, 'reread_s', places=3)} | {median(rows, 'start_s')} "
            f"| {len(rows) - len(ok)} |"
        )
    lines += ["", "Each run:", "", "```"]
    lines += [f"{arm}: {json.dumps(row)}" for arm, rows in arms.items() for row in rows]
    lines += ["```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
