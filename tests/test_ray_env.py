"""``vllm-xpu-memfix ray-env`` on constructed hosts (tests/hosts.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hosts import B70, build_host

from vllm_xpu_memfix.cli import main
from vllm_xpu_memfix.fixes import driver_env

EXPORTS = ["export NEOReadDebugKeys=1", "export EnableDeferBacking=0"]
RUNTIME_ENV = {"env_vars": {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}}


@pytest.fixture
def node(tmp_path, monkeypatch, clean_env):
    for name in (*driver_env.DRIVER_KEYS, "ZE_AFFINITY_MASK"):
        monkeypatch.delenv(name, raising=False)

    def at(gpus, **kwargs):
        root = build_host(tmp_path / f"host{len(list(tmp_path.iterdir()))}", gpus, **kwargs)
        monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(root))
        return root

    return at


def run(capsys, *args):
    code = main(["ray-env", *args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def findings(out: list[str]) -> list[str]:
    """The comment lines as findings: a wrapped line's continuations (indented 4 or more
    past ``#``) joined back to it."""
    said: list[str] = []
    for line in out:
        text = line.removeprefix("#")
        if said and text.startswith("    ") and line.startswith("#"):
            said[-1] += " " + text.strip()
        else:
            said.append(text.strip() if line.startswith("#") else line)
    return said


def test_an_affected_node_gets_export_lines_and_the_runtime_env(node, capsys):
    node([B70] * 4)
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert findings(out)[0] == (
        "this node needs the driver guard: 4 Battlemage GPUs visible, compute-runtime "
        "26.14.37833.4-1~24.04 (compute-runtime #953, #980; vllm #50269)"
    )
    assert [line for line in out if not line.startswith("#")] == EXPORTS
    assert json.loads(out[-1].removeprefix("# ")) == RUNTIME_ENV
    assert any("before `ray start`" in line for line in out)
    assert run(capsys, "--json")[1] == [json.dumps(RUNTIME_ENV)]


def test_the_output_can_be_evaluated_by_a_shell(node):
    root = node([B70] * 2)
    script = f'eval "$({sys.executable} -m vllm_xpu_memfix.cli ray-env)"; echo $EnableDeferBacking'
    shell = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={
            "VLLM_XPU_MEMFIX_SYSROOT": str(root),
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ":".join(sys.path),
        },
        timeout=60,
    )
    assert (shell.returncode, shell.stdout, shell.stderr) == (0, "0\n", "")


def test_a_node_without_intel_gpus_gets_one_line(tmp_path, monkeypatch, clean_env, capsys):
    monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(tmp_path))
    code, out, err = run(capsys)
    assert (code, err) == (0, "")
    assert findings(out) == [
        f"this node needs no driver variables: no Intel GPU visible under "
        f"{tmp_path}/sys/class/drm; the host copy needs 2 or more Battlemage"
    ]
    assert all(len(line) <= 100 for line in out)
    assert run(capsys, "--json")[1] == ['{"env_vars": {}}']


def test_it_decides_as_the_guard_does(node, capsys):
    node([B70] * 2, runtime="26.05.37020.3")
    assert findings(run(capsys)[1]) == [
        "this node needs no driver variables: compute-runtime 26.05.37020.3-1~24.04 is "
        "outside the affected range (from 26.09.37435.1)"
    ]
    node([B70] * 4)
    assert run(capsys)[1][0].startswith("# this node needs the driver guard")


def test_variables_in_this_shell_do_not_hide_what_the_node_needs(node, capsys, monkeypatch):
    node([B70] * 4)
    monkeypatch.setenv("EnableDeferBacking", "0")
    code, out, _ = run(capsys)
    assert code == 0 and [line for line in out if not line.startswith("#")] == EXPORTS
    assert out[-1] == "# this shell already has EnableDeferBacking=0"


def test_missing_ray_is_one_line_and_no_crash(node, capsys, monkeypatch):
    node([B70] * 4)
    monkeypatch.setitem(sys.modules, "ray", None)
    code, out, _ = run(capsys)
    assert code == 0
    assert [line for line in findings(out) if "Ray" in line and "install" in line] == [
        "Ray is not installed in this environment; vLLM's Ray executor needs it where vLLM "
        "runs (pip install ray)"
    ]


def test_a_bad_sysroot_is_one_line_and_exit_2(tmp_path, monkeypatch, clean_env, capsys):
    monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(tmp_path / "missing"))
    code, out, err = run(capsys)
    assert (code, out) == (2, [])
    assert err.count("\n") == 1 and "VLLM_XPU_MEMFIX_SYSROOT=" in err and "Traceback" not in err


def test_no_peer_access_prints_its_variables_and_their_cost(node, capsys, monkeypatch):
    node([B70] * 2)
    monkeypatch.setenv("VLLM_XPU_MEMFIX_DRIVER_ENV", "no_peer_access")
    code, out, _ = run(capsys)
    assert code == 0
    assert [line for line in out if not line.startswith("#")] == [
        "export NEOReadDebugKeys=1",
        "export ForceZeDeviceCanAccessPerReturnValue=0",
    ]
    assert any(
        "turns P2P off: oneCCL falls back to its USM (host-staged) collectives" in line
        for line in findings(out)
    )
    assert json.loads(run(capsys, "--json")[1][0]) == {
        "env_vars": {"NEOReadDebugKeys": "1", "ForceZeDeviceCanAccessPerReturnValue": "0"}
    }


def test_a_node_that_meets_compute_runtime_916_is_warned(node, capsys):
    node([B70] * 2, kernel="6.14.0-37-generic")
    out = run(capsys)[1]
    said = findings(out)
    (at,) = [i for i, line in enumerate(said) if "compute-runtime #916" in line]
    assert said[at].startswith("compute-runtime #916 could not be ruled out (2 Intel")
    assert said[at + 1].startswith("Remedies: ") and "DRIVER_ENV=no_peer_access" in said[at + 1]
    assert all(len(line) <= 100 for line in out)
    node([B70] * 2, runtime="26.05.37020.3", kernel="6.14.0-37-generic")
    out = run(capsys)[1]
    said = findings(out)
    assert said[0].startswith("this node needs no driver variables: compute-runtime 26.05")
    assert said[1].startswith("compute-runtime #916 could not be ruled out")
    assert all(line.startswith("#") and len(line) <= 100 for line in out)
