"""Markdown tables from the H200 runs recorded in docs/data/ (used in docs/design/kv-headroom.md
and docs/design/device-quant.md).

    python benchmarks/device_tables.py docs/data/kv-headroom-h200.json docs/data/q4_0-h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MiB = 1024**2


def kv_headroom(data: dict) -> str:
    lines = [
        f"vLLM path: {data['via']}; logits: {data['logits_via']}; {data['device']}, "
        f"torch {data['torch']}; medians of {data['repeats']}.",
        "",
        "| dtype | V | B | top-k/top-p | measured torch peak MiB | estimate MiB |"
        " estimate / measured | driver free-memory delta MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['dtype']} | {row['vocab']:,} | {row['batch']} | {row['path']} | "
            f"{row['torch_peak'] / MiB:,.1f} | {row['estimate'] / MiB:,.1f} | {row['ratio']:.3f} | "
            f"{row['driver_delta'] / MiB:,.0f} |"
        )
    cold = data["cold_first_call"]
    lines += [
        "",
        f"First call of the process (cold): torch peak {cold['torch_peak'] / MiB:.0f} MiB, "
        f"allocator reserve +{cold['reserved_growth'] / MiB:.0f} MiB, driver free memory "
        f"-{cold['driver_delta'] / MiB:.0f} MiB: "
        f"{(cold['driver_delta'] - cold['reserved_growth']) / MiB:.0f} MiB outside torch.",
    ]
    return "\n".join(lines)


def q4_0(data: dict) -> str:
    speed = data["speed"]
    copy = speed["copy_bandwidth"]
    lines = [
        f"{data['device']}, torch {data['torch']}, Triton {data['triton']}; "
        f"tiles {speed['tiles']}; device-to-device copy {copy / 1e12:.2f} TB/s (read + write).",
        "",
        "| exactness run | cases | elements | mismatching cases | inf/NaN refused |",
        "|---|---|---|---|---|",
    ]
    for run in data["exactness"]:
        tiles = run["tiles"] or "block_n 16, groups 1, num_warps 4 (defaults then)"
        lines.append(
            f"| tiles {tiles} | {run['cases']} | {run['elements']:,} | "
            f"{run['mismatching_cases']} | {run['non_finite_refused']} of 3 |"
        )
    lines += [
        "",
        "| layer (27B-like, TP 4) | N x K | kernel µs | GB/s | of copy (same-size copy) |"
        " quantize() µs | host path ms (all threads / 1 thread) | speed-up (all / 1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in speed["layers"]:
        lines.append(
            f"| {row['layer']} | {row['n']} x {row['k']} | {row['kernel_s'] * 1e6:.1f} | "
            f"{row['bandwidth'] / 1e9:,.0f} | {row['fraction_of_copy']:.1%} "
            f"({row.get('fraction_of_same_size_copy', float('nan')):.1%}) | "
            f"{row['quantize_call_s'] * 1e6:.0f} | {row['host_s_all_threads'] * 1e3:.0f} / "
            f"{row['host_s_one_thread'] * 1e3:.0f} | {row['speedup_all_threads']:,.0f}x / "
            f"{row['speedup_one_thread']:,.0f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        print(kv_headroom(data) if "rows" in data else q4_0(data))
        print()
