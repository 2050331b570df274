"""register() in fresh interpreters: what it imports, idempotence, switches, vLLM's env table.

Its cost is timed by ``benchmarks/register_cost.py``, not here: timings fail on a loaded machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import vllm_xpu_memfix
from vllm_xpu_memfix.core import config


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def measure_register(preload: str) -> dict:
    """Import and register() in a fresh interpreter after ``preload``: its milliseconds and
    the torch, vLLM, psutil and command modules it added."""
    result = run_python(
        f"""
        import json, sys, time
        {preload}
        before = set(sys.modules)
        t0 = time.perf_counter()
        import vllm_xpu_memfix
        vllm_xpu_memfix.register()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        added = sorted(m for m in set(sys.modules) - before
                       if m.split(".")[0] in ("torch", "vllm", "psutil")
                       or m.startswith("vllm_xpu_memfix.cli"))
        print(json.dumps({{"ms": elapsed_ms, "heavy_imports": added}}))
        """
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_register_inside_vllm_imports_nothing_of_it():
    """Where vLLM calls it: after ``vllm.plugins`` (and with it torch) is loaded."""
    pytest.importorskip("vllm")
    assert measure_register("import vllm.plugins")["heavy_imports"] == []


def test_register_in_a_bare_interpreter_imports_no_torch_vllm_psutil_or_tools():
    assert measure_register("")["heavy_imports"] == []


def test_register_logs_one_line_however_often_it_is_called():
    result = run_python("import vllm_xpu_memfix as m; m.register(); m.register(); m.register()")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "registered" in line]
    assert len(lines) == 1
    assert f"vllm-xpu-memfix {vllm_xpu_memfix.__version__}" in lines[0]
    assert "pid=" in lines[0] and "fixes on: ledger" in lines[0]


def test_master_switch_off_patches_nothing():
    result = run_python(
        """
        import vllm_xpu_memfix as m
        m.register()
        print(len(m.PATCHER.states()))
        """,
        env={"VLLM_XPU_MEMFIX": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
    assert "disabled by VLLM_XPU_MEMFIX=0" in result.stderr
    assert "registered" not in result.stderr


def test_switching_a_fix_off_leaves_its_targets_alone():
    result = run_python(
        """
        import vllm_xpu_memfix as m
        m.register()
        print(" ".join(sorted({fix for fix, _ in m.PATCHER.states()})))
        """,
        env={"VLLM_XPU_MEMFIX_LEDGER": "off"},
    )
    assert result.returncode == 0, result.stderr
    from vllm_xpu_memfix import fixes
    from vllm_xpu_memfix.core import config

    defaults = config.load({})
    expected = sorted(
        m.FIX.key for m in fixes.MODULES if m.FIX.key != "ledger" and m.patches(defaults)
    )
    assert result.stdout.split() == expected, "only the fixes left on install patches"
    assert "off: ledger" in result.stderr


JUNK = {v.name: "junk\u00e9 \x7f" for v in config.VARIABLES if v is not config.MASTER}


def test_master_switch_off_reads_no_other_switch_and_vllm_loads_it():
    """issue 52: with the plugin off, junk in every other variable never reaches vLLM."""
    pytest.importorskip("vllm")
    result = run_python(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm_xpu_memfix as m
        print(m._registered, len(m.PATCHER.states()))
        """,
        env={**JUNK, "VLLM_XPU_MEMFIX": "0", "VLLM_PLUGINS": "xpu_memfix"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0"]
    assert "not valid" not in result.stderr and "Traceback" not in result.stderr


def test_a_bad_switch_turns_its_fix_off_with_one_error_and_the_rest_start():
    result = run_python(
        """
        import vllm_xpu_memfix as m
        m.register()
        print(" ".join(sorted({fix for fix, _ in m.PATCHER.states()})))
        """,
        env={"VLLM_XPU_MEMFIX_LEDGER": "yes please", "VLLM_XPU_MEMFIX_WARMUP_SLOTS": "0"},
    )
    assert result.returncode == 0, result.stderr
    errors = [line for line in result.stderr.splitlines() if "not valid" in line]
    assert errors == [
        "ERROR vllm_xpu_memfix: vllm-xpu-memfix: VLLM_XPU_MEMFIX_LEDGER='yes please' is not valid; "
        "accepted values: auto, on, off; turned off: ledger",
        "ERROR vllm_xpu_memfix: vllm-xpu-memfix: VLLM_XPU_MEMFIX_WARMUP_SLOTS='0' is not valid; "
        "accepted values: an integer from 1 to 1024; turned off: warmup_lock",
    ]
    patched = result.stdout.split()
    assert "ledger" not in patched and "warmup_lock" not in patched
    assert "host_release" in patched, "the other fixes start"
    assert "off: ledger" in result.stderr


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("~nouser-memfix/ledger", "cannot be used: Could not determine home directory;"),
        ("/tmp/" + "x" * 300, "cannot be used: File name too long;"),
        ("{afile}", "this path is not a directory;"),
        ("{afile}/ledger", "cannot be used: Not a directory;"),
        # Root writes wherever file modes say no; /proc/sys refuses even root.
        ("/proc/sys/vllm-xpu-memfix", "/proc/sys is not writable;"),
    ],
)
def test_no_path_raises_from_register_and_an_engine_process_does_not_repeat_it(
    tmp_path, path, says
):
    """Issue 59: any exception while a switch is read is its fix off with one ERROR, from the
    process that starts vLLM; an EngineCore (which inherits the start identity) says it at
    DEBUG only."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    env = {"VLLM_XPU_MEMFIX_LEDGER_DIR": path.format(afile=afile)}
    code = """
        import multiprocessing, sys
        if sys.argv[1:] == ["engine"]:
            multiprocessing.current_process().name = "EngineCore_DP0"
        import vllm_xpu_memfix as m
        m.register()
        print(" ".join(sorted({fix for fix, _ in m.PATCHER.states()})))
        """
    main = run_python(code, env=env)
    assert main.returncode == 0, main.stderr
    (error,) = [line for line in main.stderr.splitlines() if "LEDGER_DIR=" in line]
    assert error.startswith("ERROR ") and says in error and error.endswith("turned off: ledger")
    assert "ledger" not in main.stdout.split() and "host_release" in main.stdout.split()
    engine = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "engine"],
        env={**os.environ, **env, "VLLM_XPU_MEMFIX_START": "1-2-abc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert engine.returncode == 0, engine.stderr
    assert "LEDGER_DIR=" not in engine.stderr and "off: ledger" in engine.stderr


def test_a_bad_master_value_turns_the_plugin_off_with_one_error():
    result = run_python(
        "import vllm_xpu_memfix as m; m.register(); print(len(m.PATCHER.states()))",
        env={**JUNK, "VLLM_XPU_MEMFIX": "2"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
    errors = [line for line in result.stderr.splitlines() if "not valid" in line]
    assert errors == [
        "ERROR vllm_xpu_memfix: vllm-xpu-memfix: VLLM_XPU_MEMFIX='2' is not valid; "
        "accepted values: 1, on, true, yes / 0, off, false, no; the plugin is off"
    ]


def test_refuse_stops_on_any_bad_value_and_a_bad_preflight_value_is_not_refuse():
    strict = run_python(
        "import vllm_xpu_memfix as m; m.register()",
        env={"VLLM_XPU_MEMFIX_PREFLIGHT": "refuse", "VLLM_XPU_MEMFIX_LOAD_SCOPE": "world"},
    )
    assert strict.returncode != 0
    assert "ConfigError: VLLM_XPU_MEMFIX_LOAD_SCOPE='world' is not valid" in strict.stderr
    assert "VLLM_XPU_MEMFIX_PREFLIGHT=refuse stops on a bad value" in strict.stderr
    lenient = run_python(
        "import vllm_xpu_memfix as m; m.register()",
        env={"VLLM_XPU_MEMFIX_PREFLIGHT": "refuse!"},
    )
    assert lenient.returncode == 0, lenient.stderr
    assert "VLLM_XPU_MEMFIX_PREFLIGHT='refuse!' is not valid" in lenient.stderr
    assert "turned off: preflight" in lenient.stderr


def test_vllm_knows_the_plugin_variables_after_registration():
    pytest.importorskip("vllm")
    result = run_python(
        """
        import vllm.envs as envs
        from vllm.platforms.interface import Platform
        assert "VLLM_XPU_MEMFIX_LEDGER" not in envs.environment_variables
        import vllm_xpu_memfix
        vllm_xpu_memfix.register()
        Platform.validate_environ(hard_fail=True)  # raises on an unknown VLLM_* variable
        print(envs.VLLM_XPU_MEMFIX_LEDGER, envs.VLLM_XPU_MEMFIX)
        """,
        env={"VLLM_XPU_MEMFIX_LEDGER": "on"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["on", "1"]
