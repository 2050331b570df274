"""The report doctor prints: its fields, as JSON, and as text for a person."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.startup.sizing import ServeArgs

SELF_CHECK = "device_quant self-check"
LONG_LINES = ("sym_int4", SELF_CHECK)  # plugin entries rendered on lines of their own


@dataclass
class Report:
    host: dict[str, Any]
    gpus: dict[str, Any]
    environment: dict[str, str]
    plugin: dict[str, str]
    model: dict[str, Any] | None
    per_rank: dict[str, float]
    total: dict[str, float]
    verdict: str
    main_cause: str  # a cause code
    why: str = ""  # where and how much: "host at kv_cache: 91% of the host's room"
    host_judged: bool = True
    notes: list[str] = field(default_factory=list)
    machine: str = "this machine"
    fails_at: dict[str, str] | None = None
    phases: dict[str, dict[str, float | None]] = field(default_factory=dict)
    causes: list[dict[str, Any]] = field(default_factory=list)
    remedies: list[dict[str, Any]] = field(default_factory=list)
    not_helping: list[dict[str, Any]] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def verdict_line(report: Report) -> str:
    """``Verdict: AT RISK (host at kv_cache: 91% of the host's room; main cause: ...)``."""
    parts = [report.why] if report.why else []
    parts.append(f"main cause: {report.main_cause}")
    if not report.host_judged:
        parts.append("not judged on the host: no RAM figures")
    return f"Verdict: {report.verdict.upper()} ({'; '.join(parts)})"


def gib(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value / GiB:,.1f} GiB" if abs(value) >= GiB else f"{value / 2**20:,.0f} MiB"


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} GiB"


def _outcome_lines(report: Report) -> list[str]:
    """The phases, the causes and the remedies."""
    lines = ["Phases (host: all ranks of the host; device: per rank)"]
    for name, phase in report.phases.items():
        mark = ""
        if report.fails_at and report.fails_at["phase"] == name:
            mark = f"  <- runs out on the {report.fails_at['where']}"
        lines.append(
            f"  {name:<9} host {_figure(phase['host_gib']):>11}   "
            f"device {_figure(phase['device_gib']):>10}{mark}"
        )
    lines.append("Causes")
    lines += [f"  {c['code']:<22} {c['gib']:>8,.1f} GiB  {c['why']}" for c in report.causes]
    if report.remedies:
        lines.append("Remedies (the cheapest that fits first)")
        lines += [_remedy_line(r) for r in report.remedies]
    if report.not_helping:
        lines.append("Does not help")
        lines += [_remedy_line(r) for r in report.not_helping]
    lines += [f"  assumed: {a}" for a in report.assumed]
    if report.not_modelled:
        lines.append(f"  not modelled: {' '.join(report.not_modelled)}")
    return lines


def _remedy_line(remedy: dict[str, Any]) -> str:
    return (
        f"  {remedy['code']}: {remedy['what']} -> {remedy['verdict_after']}, host "
        f"{remedy['host_need_after_gib']:,.1f} GiB; cost: {remedy['cost']}"
    )


def render(report: Report, args: ServeArgs) -> str:
    host, gpus = report.host, report.gpus
    limit = "none" if host["cgroup_max"] is None else gib(host["cgroup_max"])
    lines = [
        f"Host ({report.machine})",
        f"  RAM {gib(host['mem_total'])}, available {gib(host['mem_available'])}, "
        f"swap {gib(host['swap_total'])} ({gib(host['swap_free'])} free), cgroup limit {limit}",
        "GPUs",
        *(f"  {gpu}" for gpu in gpus["intel_gpus"] or ["no Intel GPU found in sysfs"]),
        f"  visible: {gpus['visible']} ({gpus['visible_battlemage']} Battlemage); device memory "
        f"{gib(gpus['device_memory_bytes'])} ({gpus['device_memory_source']})",
        f"  compute-runtime {gpus['compute_runtime']}; "
        f"Level Zero loader {gpus['level_zero_loader']}; kernel {gpus.get('kernel', 'unknown')}",
        f"  driver guard {gpus['driver_guard']}",
        "Environment",
        *(f"  {k}={v}" for k, v in report.environment.items()),
        *([] if report.environment else ["  (none of the relevant variables is set)"]),
        "Plugin switches",
        "  " + ", ".join(f"{k}={v}" for k, v in report.plugin.items() if k not in LONG_LINES),
        *(f"  {key}: {report.plugin[key]}" for key in LONG_LINES if key in report.plugin),
    ]
    if report.model:
        model = report.model
        size_from = (
            "" if model["size_from"] == "safetensors headers" else f" (from {model['size_from']})"
        )
        lines += [
            "Model",
            f"  {model['model']}: {model['shards']} shard(s) read, "
            f"{gib(model['checkpoint_bytes'])} {model['checkpoint_dtype']}{size_from}; "
            f"weights on each device {gib(model['device_weight_bytes_per_rank'])}",
        ]
    per_rank = report.per_rank
    lines += [
        f"Per rank (TP {args.tensor_parallel_size}, "
        f"--gpu-memory-utilization {args.gpu_memory_utilization})",
        f"  device memory in use   {gib(per_rank['device_use'])}",
        f"  host: driver copy      {gib(per_rank['host_copy'])}",
        f"  host: quant. staging   {gib(per_rank['quantization_staging'])}",
        f"  host: process baseline {gib(per_rank['process_baseline'])}",
        "Host total",
        f"  need {gib(report.total['host_need'])} + checkpoint page cache "
        f"{gib(report.total['page_cache'])} (reclaimable), "
        f"against the {report.host['room_detail']}",
        *_outcome_lines(report),
        verdict_line(report),
        *(f"  note: {note}" for note in report.notes),
    ]
    return "\n".join(lines)
