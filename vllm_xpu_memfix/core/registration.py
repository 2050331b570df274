"""What :func:`vllm_xpu_memfix.register` reads: the settings it acts on, never raising for
a bad value unless the user asked for strictness, and vLLM's variable table told of the
plugin's variables. The tools (``check``, ``doctor``) read with :func:`config.load`,
which refuses any bad value."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

from vllm_xpu_memfix.core.config import (
    MASTER,
    PARAMETERS,
    PREFIX,
    PREFLIGHT,
    SWITCHES,
    VARIABLES,
    Mode,
    Settings,
    Variable,
    load,
    read_variable,
)
from vllm_xpu_memfix.core.numbers import ConfigError
from vllm_xpu_memfix.core.process import START_VARIABLE


def settings_at_start(environ: Mapping[str, str] | None = None) -> tuple[Settings, tuple[str, ...]]:
    """The settings ``register()`` acts on, and one refusal line per bad variable.

    ``VLLM_XPU_MEMFIX=0`` reads no other variable; a bad master value turns the plugin off.
    With the plugin on, a bad value turns off the fixes that read it (``Variable.fixes``)
    and the rest start. Raises :class:`ConfigError` only where the preflight is
    ``refuse``: the user asked for strictness. A bad ``VLLM_XPU_MEMFIX_PREFLIGHT`` is not
    ``refuse``, so it only turns the preflight off."""
    env = os.environ if environ is None else environ
    try:
        enabled = read_variable(MASTER, env)
    except ConfigError as exc:
        return load({PREFIX: "0"}), (f"{exc}; the plugin is off",)
    if not enabled:
        return load({PREFIX: "0"}), ()
    bad: list[tuple[Variable, ConfigError]] = []

    def read_or_default(variable: Variable) -> Any:
        try:
            return read_variable(variable, env)
        except ConfigError as exc:
            bad.append((variable, exc))
            return variable.parse(variable, variable.default, env)

    modes = {key: read_or_default(switch) for key, switch in SWITCHES.items()}
    values = {variable.field: read_or_default(variable) for variable in PARAMETERS}
    if bad and modes[PREFLIGHT.key] is Mode.REFUSE:
        raise ConfigError(f"{bad[0][1]} ({PREFLIGHT.env}=refuse stops on a bad value)")
    lines = []
    for variable, error in bad:
        modes.update(dict.fromkeys(variable.fixes, Mode.OFF))
        lines.append(f"{error}; turned off: {', '.join(variable.fixes)}")
    return Settings(enabled=True, modes=modes, **values), tuple(lines)


def announce_to_vllm() -> None:
    """Add the plugin's variables to vLLM's environment table.

    vLLM warns about every ``VLLM_*`` variable missing from
    ``vllm.envs.environment_variables``. Versions without that table are left
    alone. Note that vLLM hashes the known variables into its torch.compile
    cache key, so changing a plugin switch also starts a fresh compile cache.
    """
    envs = sys.modules.get("vllm.envs")
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for variable in VARIABLES:
        table.setdefault(
            variable.name, functools.partial(os.environ.get, variable.name, variable.default)
        )
    # The start-up's identity is new at every start: its getter gives a constant, so that
    # vLLM's compile-cache key (0.32 envs.compile_factors hashes every getter) stays the same.
    table.setdefault(START_VARIABLE, lambda: None)
