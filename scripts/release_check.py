"""``make release-check``: the sdist and wheel in dist/ are fit to publish.

Run with the test bed's Python after ``make wheel`` and ``twine check --strict``:

1. contents: the wheel carries the licence (``License-File``), ``py.typed`` and the
   version of ``vllm_xpu_memfix.__version__`` (the tag's, with ``--tag``); the sdist carries
   the licence and the changelog and no tests (they need the checkout's conftest and data);
2. a clean venv without vLLM: the wheel installs with its dependencies, every command's
   ``--help`` runs, describes the command and fits 100 columns, ``doctor`` writes and judges
   this machine's file, ``explain`` prints an entry with no pointer to a page the wheel
   lacks and leaves quietly when its reader closes the pipe, and ``demo`` says in one line
   what is missing and creates nothing;
3. the changelog (Keep a Changelog): a tag needs its dated section, ``## [X.Y.Z] - DATE``,
   which ``--notes-for vX.Y.Z`` prints for the GitHub Release; before it, the newest
   section is ``[Unreleased]`` or the version's;
4. the test bed: the wheel installed with ``--no-deps --target`` a scratch directory (the
   shared editable install is left alone), a real vLLM server started with that directory
   first on ``PYTHONPATH``, and the plugin's entry point seen loading from it in each process.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_xpu_memfix"


# Where the plugin's module and the distribution of its vLLM entry point are loaded from.
WHERE_FROM = """
import importlib.metadata as m, vllm_xpu_memfix as p
(ep,) = [e for e in m.entry_points(group="vllm.general_plugins") if e.name == "xpu_memfix"]
print(p.__file__, ep.dist.locate_file(""))
"""


class ReleaseError(RuntimeError):
    """What makes the release unfit, in one line."""


SECTION = re.compile(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?[ \t]*$", re.M)


def changelog_notes(expected: str, tagged: bool, text: str | None = None) -> str:
    """The changelog's section for release ``expected``, without its heading: on a tag,
    ``[expected]`` with its date; before, the newest section, ``[Unreleased]`` or
    ``[expected]``. Raises :class:`ReleaseError` where it is not there or empty."""
    text = (ROOT / "CHANGELOG.md").read_text() if text is None else text
    sections = list(SECTION.finditer(text))
    if not sections:
        raise ReleaseError("CHANGELOG.md has no `## [VERSION] - DATE` section")
    wanted = [m for m in sections if m.group(1) == expected and (m.group(2) or not tagged)]
    if not tagged and sections[0].group(1) == "Unreleased":
        wanted = sections[:1]
    if not wanted or (tagged and sections[0] is not wanted[0]):
        need = f"## [{expected}] - YYYY-MM-DD" if tagged else f"[Unreleased] or [{expected}]"
        raise ReleaseError(f"CHANGELOG.md's newest section is not {need}")
    later = [m.start() for m in sections if m.start() > wanted[0].start()]
    body = text[wanted[0].end() : later[0] if later else len(text)].strip()
    if not body:
        raise ReleaseError(f"CHANGELOG.md's section [{wanted[0].group(1)}] is empty")
    return body


def version() -> str:
    """``__version__`` read from the source, the one place it is written."""
    text = (ROOT / PACKAGE / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.M)
    if match is None:
        raise ReleaseError(f"{PACKAGE}/__init__.py has no __version__ line")
    return match.group(1)


def artifacts(dist: Path) -> tuple[Path, Path]:
    """The one sdist and the one wheel of this project in ``dist``."""
    sdists = sorted(dist.glob("vllm_xpu_memfix-*.tar.gz"))
    wheels = sorted(dist.glob("vllm_xpu_memfix-*-py3-none-any.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        found = [p.name for p in [*sdists, *wheels]]
        raise ReleaseError(f"{dist} should hold one sdist and one wheel, not {found}")
    return sdists[0], wheels[0]


def wheel_problems(wheel: Path, expected_version: str) -> list[str]:
    """What the wheel lacks of a release: licence, typing marker, metadata, version."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"vllm_xpu_memfix-{expected_version}.dist-info"
        metadata_name = f"{info}/METADATA"
        if metadata_name not in names:
            return [f"no {metadata_name} (the wheel's version differs from {expected_version})"]
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
        licence_name = f"{info}/licenses/LICENSE"
        licence = archive.read(licence_name) if licence_name in names else None
    problems = []
    if metadata.get("Version") != expected_version:
        problems.append(f"Version {metadata.get('Version')} is not {expected_version}")
    if metadata.get("License-Expression") != "Apache-2.0":
        problems.append(f"License-Expression is {metadata.get('License-Expression')}")
    if "LICENSE" not in metadata.get_all("License-File", []):
        problems.append("no License-File: LICENSE in METADATA")
    if licence != (ROOT / "LICENSE").read_bytes():
        problems.append(f"{info}/licenses/LICENSE is missing or differs from LICENSE")
    if f"{PACKAGE}/py.typed" not in names:
        problems.append(f"no {PACKAGE}/py.typed")
    if any(name.startswith(("tests/", "benchmarks/")) for name in names):
        problems.append("tests or benchmarks in the wheel")
    return problems


def sdist_problems(sdist: Path, expected_version: str) -> list[str]:
    """What the sdist lacks of a release, or ships that cannot run (the tests)."""
    top = f"vllm_xpu_memfix-{expected_version}"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    problems = [
        f"no {name}" for name in ("LICENSE", "CHANGELOG.md", "PKG-INFO") if name not in names
    ]
    if f"{PACKAGE}/__init__.py" not in names:
        problems.append(f"no {top}/{PACKAGE}/__init__.py (the sdist's version differs?)")
    problems += [f"ships {name}" for name in sorted(names) if name.startswith("tests/")][:3]
    return problems


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """``argv``'s stdout; a failure raises with the tail of its output."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise ReleaseError(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{tail}")
    return str(done.stdout)


def clean_venv_runs_the_cli(wheel: Path, python: str, scratch: Path, expected: str) -> list[str]:
    """Install the wheel into a new venv without vLLM; run every command's ``--help`` and
    ``doctor`` on this machine's file. Returns the commands run."""
    venv = scratch / "clean-venv"
    # Nothing of the checkout may be seen: no PYTHONPATH, and not its directory as cwd.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def clean(*argv: str, offline: bool = False) -> str:
        return run(list(argv), env={**env, "HF_HUB_OFFLINE": "1"} if offline else env, cwd=scratch)

    clean(python, "-m", "venv", str(venv))
    clean(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel))
    find = "import importlib.util as u; print([m for m in ('vllm', 'torch') if u.find_spec(m)])"
    present = clean(str(venv / "bin" / "python"), "-c", find).strip()
    if present != "[]":
        raise ReleaseError(f"the clean venv has {present}: the wheel pulled them in")
    cli = str(venv / "bin" / "vllm-xpu-memfix")
    shown = clean(cli, "--version").strip()
    if shown != expected:
        raise ReleaseError(f"vllm-xpu-memfix --version says {shown}, not {expected}")
    commands = re.search(r"\{([\w,-]+)\}", clean(cli, "--help"))
    if commands is None:
        raise ReleaseError("vllm-xpu-memfix --help lists no commands")
    ran = ["--version", "--help"]
    for command in commands.group(1).split(","):
        shown = run([cli, command, "--help"], env={**env, "COLUMNS": "100"}, cwd=scratch)
        described = shown.split("\n\n")[1] if "\n\n" in shown else ""
        if described.startswith(("positional arguments", "options")) or not described:
            raise ReleaseError(f"{command} --help describes nothing:\n{shown[:500]}")
        wide = [line for line in shown.splitlines() if len(line) > 100]
        if wide:
            raise ReleaseError(f"{command} --help is wider than 100 columns: {wide[0]!r}")
        ran.append(f"{command} --help")
    host = str(scratch / "host.toml")
    clean(cli, "doctor", "--write-host", host)
    planned = ("doctor", "--host", host, "--params", "1B", "--", "vllm", "serve", "m")
    judged = clean(cli, *planned, offline=True)
    if "Verdict: " not in judged:
        raise ReleaseError(f"doctor gave no verdict without vLLM:\n{judged[-500:]}")
    entry = clean(cli, "explain", "device_overcommit")
    if "device_overcommit" not in entry or len(entry.splitlines()) < 3:
        raise ReleaseError(f"explain printed no entry from the wheel:\n{entry[-500:]}")
    for code in ("driver_host_copy", "process_baseline", "sampler_burst"):
        if re.search(r"\]\((?![a-z]+://)", clean(cli, "explain", code)):
            raise ReleaseError(f"explain {code} points at a page the wheel lacks")
    closed = subprocess.Popen(
        [cli, "explain"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=scratch
    )
    assert closed.stdout is not None
    closed.stdout.close()  # the reader is gone before the first line, as `| head -0`
    _, said = closed.communicate(timeout=120)
    if b"Traceback" in said or closed.returncode != 141:
        raise ReleaseError(
            f"explain into a closed pipe exited {closed.returncode}: {said[-500:]!r}"
        )
    demo = subprocess.run(
        [cli, "demo", "--workdir", "demo-here"],
        capture_output=True,
        text=True,
        env=env,
        cwd=scratch,
    )
    if demo.returncode != 2 or "vllm" not in demo.stderr or len(demo.stderr.splitlines()) != 1:
        raise ReleaseError(f"demo without vLLM exited {demo.returncode}: {demo.stderr[-500:]}")
    if (scratch / "demo-here").exists():
        raise ReleaseError("demo without vLLM created its directory")
    report = clean(cli, "report")
    if "vllm-xpu-memfix" not in report or "not installed" not in report:
        raise ReleaseError(f"report without vLLM did not say so:\n{report[-500:]}")
    return [
        *ran,
        "doctor --write-host",
        "doctor --host",
        "explain CODE",
        "explain into a closed pipe",
        "demo without vLLM",
        "report",
    ]


def serve_with_the_wheel(wheel: Path, scratch: Path, expected: str) -> list[str]:
    """``pip install --no-deps --target`` the wheel, serve a tiny model with that copy first
    on ``PYTHONPATH``; returns the plugin's "registered" lines."""
    from vllm_xpu_memfix.cli.demo import plugin_lines
    from vllm_xpu_memfix.cli.demo.server import Server
    from vllm_xpu_memfix.cli.demo.tiny_model import make_model

    site = scratch / "site"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ]
    )
    env = {"PYTHONPATH": str(site)}
    seen = run([sys.executable, "-c", WHERE_FROM], env={**os.environ, **env}, cwd=scratch).split()
    if not all(Path(path).is_relative_to(site) for path in seen):
        raise ReleaseError(f"the plugin or its entry point does not come from {site}: {seen}")
    model = make_model(scratch / "model")
    with Server(model, scratch / "server.log", env=env) as server:
        server.wait_ready()
        registered = [line for line in plugin_lines(server.log_text()) if " registered " in line]
    if len(registered) < 2 or not all(
        f"vllm-xpu-memfix {expected} registered" in line for line in registered
    ):
        raise ReleaseError(f"expected the API server's and the engine's line: {registered}")
    return registered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "dist",
        type=Path,
        nargs="?",
        default=ROOT / "dist",
        help="the sdist's and wheel's directory",
    )
    parser.add_argument("--tag", help="the release's git tag (vX.Y.Z): must name the version")
    parser.add_argument("--python", default="python3", help="Python for the clean venv")
    parser.add_argument(
        "--notes", action="store_true", help="only print the changelog's notes for --tag"
    )
    args = parser.parse_args(argv)
    expected = version()
    try:
        if args.tag is not None and args.tag != f"v{expected}":
            raise ReleaseError(f"tag {args.tag} does not name version {expected}")
        notes = changelog_notes(expected, tagged=args.tag is not None)
        if args.notes:
            print(notes)
            return 0
        print(f"release-check: CHANGELOG.md has the notes ({len(notes.splitlines())} lines)")
        sdist, wheel = artifacts(args.dist.resolve())
        problems = wheel_problems(wheel, expected) + sdist_problems(sdist, expected)
        if problems:
            raise ReleaseError("; ".join(problems))
        print(f"release-check: {sdist.name} and {wheel.name} carry LICENSE, py.typed, no tests")
        with tempfile.TemporaryDirectory(prefix="release-check-") as tmp:
            t0 = time.monotonic()
            ran = clean_venv_runs_the_cli(wheel, args.python, Path(tmp), expected)
            print(
                f"release-check: clean venv, no vLLM: {', '.join(ran)} "
                f"({time.monotonic() - t0:.0f} s)"
            )
            t0 = time.monotonic()
            registered = serve_with_the_wheel(wheel, Path(tmp), expected)
            print(
                f"release-check: vLLM served with the wheel's copy ({time.monotonic() - t0:.0f}"
                f" s); {len(registered)} processes registered it, e.g.\n  {registered[0]}"
            )
    except ReleaseError as exc:
        print(f"release-check: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
