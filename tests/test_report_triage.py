"""``report`` as complete as ``vllm collect-env`` for a memory issue (issue 53, item 4): the
OS, CPU, swap, compilers, XPU Python packages, other vLLM plugins, allocator, OOM kills
and the start-up's command line and OOM kill, from a constructed host tree (tests/hosts.py)
and package metadata made at test time (no Intel GPU host or XPU wheel can be reached
here: the tree and the metadata are stand-ins of what those write)."""

from __future__ import annotations

import json
from pathlib import Path

from hosts import B70, build_host
from test_report import cell, run_report

KILL = "Out of memory: Killed process 4711 (python3) total-vm:99000000kB, anon-rss:88000000kB"


def triage_host(root: Path) -> Path:
    host = build_host(root, [B70, B70])
    (host / "etc").mkdir()
    (host / "etc/os-release").write_text('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 24.04.2 LTS"\n')
    cpu = "processor\t: {}\nmodel name\t: Intel(R) Xeon(R) w5-3435X\n\n"
    (host / "proc/cpuinfo").write_text("".join(cpu.format(i) for i in range(4)))
    meminfo = (host / "proc/meminfo").read_text()
    meminfo = meminfo.replace("SwapTotal:             0 kB", "SwapTotal:       8388608 kB")
    (host / "proc/meminfo").write_text(
        meminfo.replace("SwapFree:              0", "SwapFree: 4194304")
    )
    with (host / "var/lib/dpkg/status").open("a") as status:
        status.write(
            "\nPackage: intel-igc-core-2\nStatus: install ok installed\nVersion: 2.11.7\n"
            "\nPackage: intel-oneapi-runtime-dpcpp-cpp\nStatus: install ok installed\n"
            "Version: 2025.1.1-1\n"
        )
    for version in ("2025.1", "latest"):
        (host / "opt/intel/oneapi/compiler" / version).mkdir(parents=True)
    (host / "proc/vmstat").write_text("nr_free_pages 1\noom_kill 3\n")
    (host / "sys/fs/cgroup").mkdir(parents=True)
    (host / "sys/fs/cgroup/memory.events").write_text("low 0\noom 1\noom_kill 1\n")
    (host / "var/log").mkdir()
    (host / "var/log/kern.log").write_text(
        f"Dec  6 07:00:00 gpu-box kernel: [1.0] eth0 up\nDec  6 07:01:00 gpu-box kernel: {KILL}\n"
    )
    return host


def site_packages(root: Path) -> Path:
    """Metadata as an XPU wheel and another vLLM plugin install it."""
    site = root / "site"
    ipex = site / "intel_extension_for_pytorch-2.8.10+xpu.dist-info"
    ipex.mkdir(parents=True)
    (ipex / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: intel-extension-for-pytorch\nVersion: 2.8.10+xpu\n"
    )
    other = site / "other_vllm_plugin-0.3.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: other-vllm-plugin\nVersion: 0.3.0\n"
    )
    (other / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nother_xpu = other_vllm_plugin.platform:register\n"
    )
    return site


def test_report_gives_what_a_triager_asks_for(tmp_path):
    import os

    host = triage_host(tmp_path / "host")
    site = site_packages(tmp_path)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    start = {"start": "90-1-cafe00", "role": "main", "pid": 90}
    rows = [
        {**start, "phase": "process start", "ts": 1.0, "argv": "vllm serve Qwen/Qwen3-8B -tp 2"},
        {
            **start,
            "phase": "killed by the OOM killer",
            "ts": 9.0,
            "oom_kill_before": 2,
            "oom_kill_after": 3,
            "victim_pid": 91,
            "victim_role": "worker-1",
            "victim_phase": "weights loaded",
            "likely_cause": "driver_host_copy",
        },
    ]
    (ledger / "ledger-gpu-box-90.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {
        "VLLM_XPU_MEMFIX_SYSROOT": str(host),
        "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(site)]),
        "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        "MALLOC_ARENA_MAX": "2",
        "PYTORCH_XPU_ALLOC_CONF": "expandable_segments:True",
    }
    result = run_report(env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert cell(out, "OS") == "Ubuntu 24.04.2 LTS"
    assert cell(out, "CPU") == "Intel(R) Xeon(R) w5-3435X, 4 logical CPUs"
    assert cell(out, "swap") == "8.0 GiB, 4.0 GiB free"
    compilers = cell(out, "Intel compilers")
    assert "intel-igc-core-2 2.11.7" in compilers
    assert "intel-oneapi-runtime-dpcpp-cpp 2025.1.1-1" in compilers
    assert "oneAPI compiler 2025.1 (" in compilers and "latest" not in compilers
    assert "intel-extension-for-pytorch 2.8.10+xpu" in cell(out, "XPU Python packages")
    plugins = cell(out, "other vLLM plugins")
    assert "other_xpu (platform_plugins: other_vllm_plugin.platform:register" in plugins
    assert "other-vllm-plugin 0.3.0" in plugins and "vllm_xpu_memfix" not in plugins
    allocator = cell(out, "allocator")
    assert allocator == "tcmalloc (LD_PRELOAD); set: MALLOC_ARENA_MAX, PYTORCH_XPU_ALLOC_CONF"
    oom = cell(out, "OOM kills")
    assert oom.startswith("oom_kill 3 since boot; cgroup oom_kill 1; last in the kernel log: ")
    assert "Killed process 4711 (python3)" in oom and "gpu-box" not in out
    assert "`vllm serve Qwen/Qwen3-8B -tp 2`" in out
    (killed,) = [line for line in out.splitlines() if line.startswith("- killed by the OOM")]
    assert "likely worker-1 pid 91 after phase 'weights loaded'" in killed
    assert "PYTORCH_XPU_ALLOC_CONF=expandable_segments:True" in out
