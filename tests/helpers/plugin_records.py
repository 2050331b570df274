"""Every record the plugin logs in a real vLLM start, as the record itself (not as a line
of vLLM's log, where a multi-line message is split and prefixed).

``capture(path)`` writes a logging configuration for ``VLLM_LOGGING_CONFIG_PATH``: vLLM's
own (its format and handler, so its log reads as always) plus a file that receives every
record of the plugin's loggers, DEBUG included, one per line with the message as a Python
literal. ``read(path)`` gives them back.
"""

from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass
from pathlib import Path

PLUGIN_LOGGER = "vllm.xpu_memfix"


@dataclass(frozen=True)
class PluginRecord:
    level: str
    pid: int
    name: str
    message: str


def capture(config_path: Path, records_path: Path) -> Path:
    from vllm import logger as vllm_logger

    config = copy.deepcopy(vllm_logger.DEFAULT_LOGGING_CONFIG)
    config["handlers"]["vllm"]["formatter"] = "vllm"  # no colour codes in a file
    config["formatters"]["plugin_records"] = {
        "format": "%(levelname)s %(process)d %(name)s %(message)r"
    }
    config["handlers"]["plugin_records"] = {
        "class": "logging.FileHandler",
        "filename": str(records_path),
        "formatter": "plugin_records",
        "level": "DEBUG",
    }
    config["loggers"][PLUGIN_LOGGER] = {
        "handlers": ["plugin_records"],
        "level": "DEBUG",
        "propagate": True,  # vLLM's own handler still prints them at its level
    }
    config_path.write_text(json.dumps(config))
    return config_path


def read(records_path: Path) -> list[PluginRecord]:
    records = []
    for line in records_path.read_text().splitlines():
        level, pid, name, message = line.split(" ", 3)
        records.append(PluginRecord(level, int(pid), name, ast.literal_eval(message)))
    return records
