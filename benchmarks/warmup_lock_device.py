"""Host-RAM transient of vLLM's Qwen Triton warm-up in 4 processes, with and without the lock.

Runs on a CUDA machine with vLLM's Python sources on PYTHONPATH (see
benchmarks/device/README.md). Each of 4 rank processes imports torch and vLLM,
starts CUDA and builds a Qwen GDN layer stand-in (the attributes that
``qwen_triton_warmup`` reads, with TP-4 shapes of a Qwen3.5-27B-like model),
then waits. On "go" each calls the real ``qwen_triton_warmup``, which
JIT-compiles its four FLA/mamba Triton kernels from an empty cache. With the
lock on, the call goes through the plugin's wrapper. The parent samples each
process's RSS every 10 ms; a process's transient is its RSS above its own level
just before "go".

    python benchmarks/warmup_lock_device.py --out DIR [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 4
MiB = 1024**2

CHILD = r"""
import os, sys, time
from types import SimpleNamespace
import torch
from vllm.model_executor.warmup import qwen_triton_warmup as qtw
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

def stand_in_layer(device):
    # Qwen3.5-27B-like GDN: 16 key heads, 48 value heads, head dims 128, conv kernel 4; TP 4.
    tp, hk, hv, dk, dv, kernel = 4, 16, 48, 128, 128, 4
    conv_dim = 2 * (hk // tp) * dk + (hv // tp) * dv
    shape = (8, conv_dim, kernel - 1) if is_conv_state_dim_first() else (8, kernel - 1, conv_dim)
    conv = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    ssm = torch.zeros((8, hv // tp, dv, dk), dtype=torch.float32, device=device)
    norm = SimpleNamespace(weight=torch.ones(dv, dtype=torch.bfloat16, device=device),
                           norm_before_gate=False, activation="silu")
    return SimpleNamespace(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                           conv_kernel_size=kernel, tp_size=tp, kv_cache=[conv, ssm], norm=norm,
                           A_log=torch.zeros(hv // tp, dtype=torch.float32, device=device),
                           dt_bias=torch.zeros(hv // tp, dtype=torch.bfloat16, device=device))

device = torch.device("cuda")
torch.ones(1, device=device)
context = {"layer": stand_in_layer(device)}
runner = SimpleNamespace(device=device, max_num_tokens=8192, is_pooling_model=False,
                         compilation_config=SimpleNamespace(static_forward_context=context))
qwen = SimpleNamespace(model_type="qwen3_5_text")
model_config = SimpleNamespace(hf_text_config=qwen, hf_config=qwen, dtype=torch.bfloat16)
warmup = qtw.qwen_triton_warmup
via = "direct"
if os.environ.get("TRIM") == "1":
    import ctypes, gc
    libc = ctypes.CDLL("libc.so.6")
    compile_only = warmup
    def warmup(r, m):
        compile_only(r, m)
        gc.collect()
        libc.malloc_trim(0)
if os.environ.get("LOCK") == "on":
    import vllm_xpu_memfix
    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.fixes import warmup_lock
    inner = warmup
    wrapper = warmup_lock._serialised("qwen_triton_warmup", config.load())
    warmup = lambda r, m: wrapper(inner, None, (r, m), {})
    via = "plugin wrapper"
print("ready", via, flush=True)
sys.stdin.readline()
started = time.time()
warmup(runner, model_config)
torch.cuda.synchronize()
def own_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
print("done", started, time.time(), own_rss(), flush=True)
sys.stdin.readline()
"""


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_once(lock: bool, trim: bool, shared_cache: bool, workdir: Path) -> dict:
    cache_root = Path(tempfile.mkdtemp(dir=workdir, prefix="triton-"))
    procs = []
    for rank in range(RANKS):
        env = dict(os.environ)
        env["TRITON_CACHE_DIR"] = str(cache_root / ("shared" if shared_cache else f"rank{rank}"))
        env["LOCK"] = "on" if lock else "off"
        env["TRIM"] = "1" if trim else "0"
        env["VLLM_XPU_MEMFIX_LOCK_DIR"] = str(workdir / "locks")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD],
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        )
    via = set()
    for p in procs:
        line = p.stdout.readline().split()
        assert line and line[0] == "ready", f"child failed: {line}"
        via.add(" ".join(line[1:]))
    baseline = {p.pid: rss(p.pid) for p in procs}
    go = time.time()
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    peak_sum, peak_each = 0, {p.pid: 0 for p in procs}
    done = {}
    import select

    while len(done) < RANKS:
        transients = {p.pid: max(0, rss(p.pid) - baseline[p.pid]) for p in procs}
        peak_sum = max(peak_sum, sum(transients.values()))
        for pid, value in transients.items():
            peak_each[pid] = max(peak_each[pid], value)
        ready, _, _ = select.select([p.stdout for p in procs if p.pid not in done], [], [], 0.01)
        for stream in ready:
            p = next(q for q in procs if q.stdout is stream)
            fields = p.stdout.readline().split()
            done[p.pid] = (float(fields[1]), float(fields[2]), int(fields[3]))
    wall = max(end for _, end, _ in done.values()) - go
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=60)
    return {
        "lock": lock,
        "trim": trim,
        "shared_cache": shared_cache,
        "via": sorted(via),
        "peak_summed_transient_mib": peak_sum / MiB,
        "peak_transient_per_rank_mib": [v / MiB for v in peak_each.values()],
        "max_single_transient_mib": max(peak_each.values()) / MiB,
        "baseline_rss_mib": statistics.median(baseline.values()) / MiB,
        "retained_after_warmup_mib": [(done[p.pid][2] - baseline[p.pid]) / MiB for p in procs],
        "warmup_s_per_rank": [round(e - s, 2) for s, e, _ in done.values()],
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="warmup-lock-"))
    results = []
    for repeat in range(args.repeats):
        for shared in (True, False):
            for lock, trim in ((False, False), (True, False), (True, True)):
                result = run_once(lock, trim, shared, workdir)
                result["repeat"] = repeat
                results.append(result)
                print(json.dumps(result), flush=True)
    (args.out / "warmup_lock_device.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
