"""The release: what the sdist and wheel carry, one version, and the Dockerfile's install step.

The sdist and the wheel are built once for the session (conftest's ``built_release``,
helpers/release_build.py), as ``python -m build`` builds them. ``make release-check`` runs
the rest: ``twine check``, the clean venv, and a real vLLM server with the wheel's copy.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import vllm_xpu_memfix

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import release_check  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_sdist_and_the_wheel_carry_the_licence_the_version_and_no_tests(built_release):
    sdist, wheel = built_release
    version = vllm_xpu_memfix.__version__
    assert wheel.name == f"vllm_xpu_memfix-{version}-py3-none-any.whl"
    assert release_check.wheel_problems(wheel, version) == []
    assert release_check.sdist_problems(sdist, version) == []


def test_the_checks_see_what_a_release_lacks(built_release, tmp_path):
    sdist, wheel = built_release
    version = vllm_xpu_memfix.__version__
    stripped = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(stripped, "w") as target:
        for item in source.infolist():
            if not item.filename.endswith(("/licenses/LICENSE", "/py.typed")):
                target.writestr(item, source.read(item))
    problems = " ".join(release_check.wheel_problems(stripped, version))
    assert "licenses/LICENSE is missing" in problems and "py.typed" in problems
    assert "differs" in release_check.wheel_problems(wheel, "9.9.9")[0]
    with_tests = tmp_path / sdist.name
    with tarfile.open(sdist) as source, tarfile.open(with_tests, "w:gz") as target:
        for member in source.getmembers():
            target.addfile(member, source.extractfile(member))
        extra = tarfile.TarInfo(f"vllm_xpu_memfix-{version}/tests/test_x.py")
        target.addfile(extra)
    assert release_check.sdist_problems(with_tests, version) == ["ships tests/test_x.py"]


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "vllm_xpu_memfix.__version__"}
    assert release_check.version() == vllm_xpu_memfix.__version__
    assert release_check.changelog_notes(vllm_xpu_memfix.__version__, tagged=False)


def test_the_changelog_is_keep_a_changelog_and_a_tag_needs_its_dated_section():
    """Before the tag, [Unreleased] is the newest section; the tag needs `## [X.Y.Z] -
    DATE` first, whose body becomes the GitHub Release's notes. Every command and fix is
    in the notes of the release that brings it."""
    from vllm_xpu_memfix.cli import build_parser
    from vllm_xpu_memfix.core import config

    version = vllm_xpu_memfix.__version__
    notes = release_check.changelog_notes(version, tagged=False)
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in [*commands, *(fix.key for fix in config.FIXES)]:
        assert f"`{name}`" in notes, name
    with pytest.raises(release_check.ReleaseError, match=r"\[0\.1\.0\] - YYYY-MM-DD"):
        release_check.changelog_notes("0.1.0", tagged=True, text="## [Unreleased]\n\n- x\n")
    dated = (
        "## [Unreleased]\n\n## [0.1.0] - 2026-12-06\n\n### Added\n\n- x\n\n"
        "## [0.0.9] - 2026-01-01\n- y\n"
    )
    with pytest.raises(release_check.ReleaseError, match="newest section"):
        release_check.changelog_notes("0.1.0", tagged=True, text=dated)
    released = dated.replace("## [Unreleased]\n\n", "")
    assert release_check.changelog_notes("0.1.0", tagged=True, text=released) == "### Added\n\n- x"
    with pytest.raises(release_check.ReleaseError, match="is empty"):
        release_check.changelog_notes("0.1.0", tagged=False, text="## [Unreleased]\n")


def test_a_tag_must_name_the_version(capsys):
    assert release_check.main(["dist", "--tag", "v0.0.0-not-it"]) == 1
    assert "does not name version" in capsys.readouterr().err


def _dockerfile_install() -> tuple[str, str]:
    """The Dockerfile's COPY destination and its RUN command (continuations joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    (copy,) = re.findall(r"^COPY \S+ (\S+)$", text, flags=re.M)
    (command,) = re.findall(r"^RUN (.+)$", text, flags=re.M)
    return copy, command


def test_the_dockerfile_names_exactly_the_plugins_dependencies():
    _, command = _dockerfile_install()
    words = shlex.split(command.split("&&")[0])
    assert words[:5] == ["${PYTHON}", "-m", "pip", "install", "--no-cache-dir"]
    assert "--no-deps" in words
    assert [w for w in words[5:] if not w.startswith(("-", "/"))] == [
        *PYPROJECT["project"]["dependencies"]
    ]


def test_the_dockerfile_install_step_runs_on_the_test_beds_python(built_release, tmp_path):
    """The image's environment stood in for by a venv layered on the test bed (vLLM, torch,
    psutil and wrapt present); the RUN line runs as written, with its Python and wheel
    directory pointed there. Only the plugin lands; nothing of the test bed changes."""
    _, wheel = built_release
    copy_to, command = _dockerfile_install()
    image_tmp = tmp_path / "image-tmp"
    image_tmp.mkdir()
    shutil.copy2(wheel, image_tmp)
    venv = tmp_path / "image-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "test-bed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    before = set(site.iterdir())
    command = command.replace(copy_to, f"{image_tmp}/").replace("${PYTHON}", str(python))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1"}
    run = {"env": env, "cwd": tmp_path, "capture_output": True, "text": True}
    done = subprocess.run(["sh", "-c", command], **run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == vllm_xpu_memfix.__version__
    added = {p.name for p in set(site.iterdir()) - before}
    assert added == {"vllm_xpu_memfix", f"vllm_xpu_memfix-{vllm_xpu_memfix.__version__}.dist-info"}
    assert list(image_tmp.iterdir()) == []
    imports = "import vllm, torch, vllm_xpu_memfix as p; print(p.__file__, vllm.__file__)"
    where = subprocess.run([python, "-c", imports], check=True, **run).stdout.split()
    assert Path(where[0]).is_relative_to(site)
    assert Path(where[1]).is_relative_to(sysconfig.get_paths()["purelib"])


def test_make_test_runs_the_release_check_and_the_workflow_runs_it_on_a_tag():
    """On a tag the workflow runs `make test` (release-check with the tag among it) before
    it publishes, gives each job only the permissions it uses, and makes the GitHub
    Release from the changelog's notes."""
    makefile = (ROOT / "Makefile").read_text()
    (test_prerequisites,) = re.findall(r"^test: (.+)$", makefile, flags=re.M)
    assert "release-check" in test_prerequisites.split()
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    assert re.search(r"^\s+tags: \[\"v\*\"\]$", workflow, flags=re.M)
    assert re.search(r"^permissions: \{\}$", workflow, flags=re.M)
    after = workflow.split("\njobs:\n", 1)[1]
    jobs = dict(re.findall(r"^  ([\w-]+):\n(.*?)(?=^  [\w-]+:\n|\Z)", after, re.M | re.S))
    assert list(jobs) == ["build", "publish", "github-release"]
    granted = {
        name: dict(re.findall(r"^      ([\w-]+): (\w+)$", body.split("steps:")[0], re.M))
        for name, body in jobs.items()
    }
    assert granted == {
        "build": {"contents": "read"},
        "publish": {"id-token": "write"},
        "github-release": {"contents": "write"},
    }
    assert "make test RELEASE_TAG=${{ github.ref_name }}" in jobs["build"]
    assert "needs: build" in jobs["publish"] and "pypa/gh-action-pypi-publish" in jobs["publish"]
    assert "needs: publish" in jobs["github-release"]
    assert "release_check.py --notes --tag" in jobs["github-release"]
    assert "gh release create" in jobs["github-release"] and "Attestations" in workflow


def test_the_readme_links_name_files_of_this_source_and_no_invented_url():
    """No repository is public yet: the metadata names no URL (a Homepage would name one
    that does not exist), and each README link is a file (and section) of this source
    tree, which a clone or a source archive has."""
    from test_docs import anchors

    assert "urls" not in PYPROJECT["project"]
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert links
    for link in links:
        assert "://" not in link, link
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), link
        assert not anchor or anchor in anchors(ROOT / path), link


def test_the_development_tools_are_a_dependency_group_not_an_extra():
    """PEP 735: ruff, mypy and pytest are in the `test` group, which setup.sh installs;
    the published metadata offers only the plot extra."""
    assert set(PYPROJECT["project"]["optional-dependencies"]) == {"plot"}
    group = {re.split(r"[<>=;\[ ]", req)[0] for req in PYPROJECT["dependency-groups"]["test"]}
    assert {"pytest", "ruff", "mypy"} <= group
    assert "--group test" in (ROOT / "scripts" / "setup.sh").read_text()


def test_the_readme_supports_what_the_metadata_and_the_version_matrix_say():
    readme = (ROOT / "README.md").read_text()
    line = readme[readme.index("**Supports**") :].split("\n\n")[0]
    vllm = re.search(r"vLLM (\d+\.\d+) to (\d+\.\d+)", line)
    header = (ROOT / "docs" / "compat.md").read_text().splitlines()[0]
    checked = re.findall(r"\| (\d+\.\d+)\.\d+ ", header)
    assert vllm is not None and checked and vllm.groups() == (checked[0], checked[-1])
    python = re.search(r"Python ≥ (\d+\.\d+)", line)
    assert python is not None and PYPROJECT["project"]["requires-python"] == f">={python[1]}"
    classified = [c.rsplit(" :: ", 1)[1] for c in PYPROJECT["project"]["classifiers"]]
    assert python[1] in classified and "Linux" in line


def _docker_lines() -> list[list[str]]:
    """Every `docker run` and `docker exec` the README's bash blocks and the Dockerfile's
    comments show, as words (continuations joined)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    comments = [
        line.removeprefix("#").strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("#")
    ]
    text = "\n".join([*blocks, "\n".join(comments)]).replace("\\\n", " ")
    return [
        shlex.split(line.split("&&")[-1])
        for line in text.splitlines()
        if re.match(r"\s*docker (run|exec) ", line.split("&&")[-1])
    ]


def _after(words: list[str], image: str) -> tuple[dict[str, list[str]], list[str]]:
    """docker's options (name -> values) and the words after the image (run) or the
    container (exec)."""
    options: dict[str, list[str]] = {}
    at = 2
    takes_value = {"--name", "--device", "--shm-size", "-p", "-v", "-e", "--entrypoint"}
    while words[at].startswith("-"):
        if words[at] in takes_value:
            options.setdefault(words[at], []).append(words[at + 1])
            at += 2
        else:
            options.setdefault(words[at], []).append("")
            at += 1
    assert words[1] == "exec" or words[at] == image, words
    return options, words[at + 1 :]


def test_the_documented_container_command_lines_parse_as_the_plugin_and_vllm_take_them(
    monkeypatch,
):
    """The serve line's arguments are `vllm serve`'s (the image's entry point), read by
    vLLM's own parser; every other command goes through --entrypoint or docker exec and
    parses as the plugin's command; each run line gives the GPUs and the ledger's volume
    the command reads."""
    from vllm_xpu_memfix.cli import build_parser

    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    monkeypatch.setenv("VLLM_PLUGINS", "none")

    lines = _docker_lines()
    image = "vllm-memfix"
    commands = []
    for words in lines:
        options, rest = _after(words, image)
        if words[1] == "run":
            assert options["--device"] == ["/dev/dri"], words
        ledgers = {v.split(":", 1)[1] for v in options.get("-v", []) if v.startswith("memfix-")}
        if words[1] == "run" and "--entrypoint" not in options:  # vllm serve
            assert options["--shm-size"] and options["-e"] == ["VLLM_XPU_MEMFIX_LEDGER_DIR=/ledger"]
            assert ledgers == {"/ledger"}
            vllm_serve = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
            parsed = vllm_serve.parse_args(rest)
            assert parsed.model_tag == rest[0] and parsed.tensor_parallel_size == 2, rest
            continue
        if words[1] == "run":
            assert options["--entrypoint"] == ["vllm-xpu-memfix"], words
        else:
            assert rest[0] == "vllm-xpu-memfix", words
            rest = rest[1:]
        args = build_parser().parse_args(rest)
        if getattr(args, "ledger", None):
            assert words[1] == "exec" or ledgers == {args.ledger}, words
        commands.append(args.command)
    assert sorted(commands) == ["check", "check", "report", "report", "report", "report"]
