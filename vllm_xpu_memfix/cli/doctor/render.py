"""The report doctor prints: its fields, as JSON, and as text for a person."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_xpu_memfix.core.lines import wrap
from vllm_xpu_memfix.core.numbers import printable
from vllm_xpu_memfix.core.units import GiB, size
from vllm_xpu_memfix.startup import codes
from vllm_xpu_memfix.startup.sizing import ServeArgs

SELF_CHECK = "device_quant self-check"
LONG_LINES = ("sym_int4", SELF_CHECK)  # plugin entries rendered on lines of their own
CODE_WIDTH, SIZE_WIDTH = 22, 12  # the causes' table: code, size, then why
WHY_COLUMN = 2 + CODE_WIDTH + 1 + SIZE_WIDTH + 2
TEXT_ONLY = ("driver_guard_lines",)  # fields the text gives and the JSON does not


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
    not_judged: tuple[str, ...] = ()  # the sides (host, device) nothing could judge
    notes: list[str] = field(default_factory=list)
    machine: str = "this machine"
    fails_at: dict[str, str] | None = None
    phases: dict[str, dict[str, float | None]] = field(default_factory=dict)
    causes: list[dict[str, Any]] = field(default_factory=list)
    remedies: list[dict[str, Any]] = field(default_factory=list)
    not_helping: list[dict[str, Any]] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    # gpus["driver_guard"], a finding a line (driver_env.summary_lines)
    driver_guard_lines: list[str] = field(default_factory=list)
    # How a pasted serve line was read (vllmline.Reading.as_dict); None: no line
    serve_line: dict[str, Any] | None = None

    def to_json(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k not in TEXT_ONLY}
        return json.dumps(fields, indent=2, default=str)


def verdict_line(report: Report) -> str:
    """``Verdict: AT RISK (host at kv_cache: 91% of the host's room; main cause: ...)``."""
    parts = [report.why] if report.why else []
    parts.append(f"main cause: {report.main_cause}")
    if codes.HOST in report.not_judged:
        parts.append("not judged on the host: no RAM figures")
    if codes.DEVICE in report.not_judged:
        parts.append("not judged on the device: its memory is not known")
    return f"Verdict: {report.verdict.upper()} ({'; '.join(parts)})"


def _figure(value: float | None) -> str:
    """A figure of the JSON (in GiB) as the text writes it."""
    return size(None if value is None else value * GiB)


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
    for c in report.causes:
        row = f"  {c['code']:<{CODE_WIDTH}} {_figure(c['gib']):>{SIZE_WIDTH}}  {c['why']}"
        lines += wrap(printable(row, limit=None), hang=WHY_COLUMN)  # the why column
    if report.remedies:
        lines.append("Remedies (those that fit first, each group the cheapest first)")
        lines += [_remedy_line(r) for r in report.remedies]
    if report.not_helping:
        lines.append("Does not help")
        lines += [_remedy_line(r) for r in report.not_helping]
    lines += [f"  assumed: {a}" for a in report.assumed]
    if report.not_modelled:
        lines.append(f"  not modelled: {' '.join(printable(w) for w in report.not_modelled)}")
    return lines


def _remedy_line(remedy: dict[str, Any]) -> str:
    removes = remedy.get("removes") or []
    gone = (
        f"; removes {', '.join(removes)}" if removes and remedy["verdict_after"] != "fits" else ""
    )
    after = remedy["verdict_after"]
    if after in (codes.RUNS_OUT, codes.WILL_FAIL):
        after = f"not enough: {after}"
    return (
        f"  {remedy['code']}: {remedy['what']} -> {after}, host "
        f"{_figure(remedy['host_need_after_gib'])}{gone}; cost: {remedy['cost']}"
    )


def render(report: Report, args: ServeArgs) -> str:
    """The report for a person. Every string that came from a file or the environment is
    escaped and cut (``numbers.printable``), and every line is escaped once more, so no
    value can forge a line or reach the terminal as a control sequence; then wrapped
    (``core.lines``). JSON is left as it is: its encoder escapes."""
    lines = [printable(line, limit=None) for line in _lines(report, args)]
    return "\n".join(part for line in lines for part in wrap(line))


def _guard_lines(report: Report) -> list[str]:
    """The driver guard's decision, then each of its remarks on a line of its own."""
    decision, *remarks = report.driver_guard_lines or [report.gpus["driver_guard"]]
    return [f"  driver guard {decision}", *(f"    {remark}" for remark in remarks)]


def _serve_line_lines(reading: dict[str, Any] | None) -> list[str]:
    if reading is None:
        return []
    lines = ["Serve line", f"  read by {reading['parser']}"]
    if reading["configuration"]:
        lines.append(f"  configuration {reading['configuration']}")
    if reading["defaults"]:
        lines.append(f"  defaults: {reading['defaults']}")
    if reading["unknown"]:
        lines.append(f"  not read (unknown to the parser): {' '.join(reading['unknown'])}")
    return lines


def _lines(report: Report, args: ServeArgs) -> list[str]:
    host, gpus = report.host, report.gpus
    limit = "none" if host["cgroup_max"] is None else size(host["cgroup_max"])
    lines = [
        f"Host ({printable(report.machine)})",
        f"  RAM {size(host['mem_total'])}, available {size(host['mem_available'])}, "
        f"swap {size(host['swap_total'])} ({size(host['swap_free'])} free), cgroup limit {limit}",
        "GPUs",
        *(f"  {printable(gpu)}" for gpu in gpus["intel_gpus"] or ["no Intel GPU found in sysfs"]),
        f"  visible: {gpus['visible']} ({gpus['visible_battlemage']} Battlemage); device memory "
        f"{size(gpus['device_memory_bytes'])} ({gpus['device_memory_source']})",
        f"  compute-runtime {printable(gpus['compute_runtime'])}; "
        f"Level Zero loader {printable(gpus['level_zero_loader'])}; "
        f"kernel {printable(gpus.get('kernel', 'unknown'))}",
        *_guard_lines(report),
        "Environment",
        *(f"  {printable(k)}={printable(v)}" for k, v in report.environment.items()),
        *([] if report.environment else ["  (none of the relevant variables is set)"]),
        "Plugin switches",
        "  "
        + ", ".join(f"{k}={printable(v)}" for k, v in report.plugin.items() if k not in LONG_LINES),
        *(f"  {key}: {report.plugin[key]}" for key in LONG_LINES if key in report.plugin),
    ]
    if report.model:
        model = report.model
        size_from = (
            "" if model["size_from"] == "safetensors headers" else f" (from {model['size_from']})"
        )
        per_rank = model["device_weight_bytes_per_rank"]
        weights = "not sized (its format is not known)" if per_rank is None else size(per_rank)
        lines += [
            "Model",
            f"  {printable(model['model'])}: {model['shards']} shard(s) read, "
            f"{size(model['checkpoint_bytes'])} {model['checkpoint_dtype']}{size_from}; "
            f"quantization {printable(model['quantization'])}; weights per rank {weights}",
        ]
    lines += _serve_line_lines(report.serve_line)
    per_rank = report.per_rank
    lines += [
        f"Per rank (TP {args.tensor_parallel_size}, "
        f"--gpu-memory-utilization {args.gpu_memory_utilization})",
        f"  device memory in use   {size(per_rank['device_use'])}",
        f"  host: driver copy      {size(per_rank['host_copy'])}",
        f"  host: quant. staging   {size(per_rank['quantization_staging'])}",
        f"  host: process baseline {size(per_rank['process_baseline'])}",
        "Host total",
        f"  need {size(report.total['host_need'])} + checkpoint page cache "
        f"{size(report.total['page_cache'])} (reclaimable), "
        f"against the {report.host['room_detail']}",
        *_outcome_lines(report),
        verdict_line(report),
        *(f"  note: {note}" for note in report.notes),
    ]
    return lines
