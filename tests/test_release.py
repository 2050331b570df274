"""The release: what the sdist and wheel carry, one version, and the Dockerfile's install step.

The sdist and the wheel are built here as ``python -m build`` builds them (the wheel from the
unpacked sdist), through setuptools' PEP 517 hooks in the test bed, from a copy of the files
git would commit. ``make release-check`` runs the rest: ``twine check``, the clean venv, and
a real vLLM server with the wheel's copy.
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


def _hook(hook: str, source: Path, out: Path) -> Path:
    """setuptools' PEP 517 ``hook`` run in ``source``; the file it wrote into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) of the files git would commit here."""
    tmp = tmp_path_factory.mktemp("release")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    source = tmp / "checkout"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    sdist = _hook("build_sdist", source, tmp / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    return sdist, _hook("build_wheel", unpacked, tmp / "dist")


def test_the_sdist_and_the_wheel_carry_the_licence_the_version_and_no_tests(built):
    sdist, wheel = built
    version = vllm_xpu_memfix.__version__
    assert wheel.name == f"vllm_xpu_memfix-{version}-py3-none-any.whl"
    assert release_check.wheel_problems(wheel, version) == []
    assert release_check.sdist_problems(sdist, version) == []


def test_the_checks_see_what_a_release_lacks(built, tmp_path):
    sdist, wheel = built
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
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+)", changelog, flags=re.M)
    assert newest is not None and newest.group(1) == vllm_xpu_memfix.__version__


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


def test_the_dockerfile_install_step_runs_on_the_test_beds_python(built, tmp_path):
    """The image's environment stood in for by a venv layered on the test bed (vLLM, torch,
    psutil and wrapt present); the RUN line runs as written, with its Python and wheel
    directory pointed there. Only the plugin lands; nothing of the test bed changes."""
    _, wheel = built
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
    makefile = (ROOT / "Makefile").read_text()
    (test_prerequisites,) = re.findall(r"^test: (.+)$", makefile, flags=re.M)
    assert "release-check" in test_prerequisites.split()
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    assert re.search(r"^\s+tags: \[\"v\*\"\]$", workflow, flags=re.M)
    assert "make release-check RELEASE_TAG=${{ github.ref_name }}" in workflow
    assert "id-token: write" in workflow and "pypa/gh-action-pypi-publish" in workflow


def test_the_readme_links_work_on_the_package_index():
    """The index page resolves no relative link: each README link is the project's URL and
    names a file (and section) of this repository."""
    from test_docs import anchors

    home = PYPROJECT["project"]["urls"]["Homepage"]
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert links
    for link in links:
        assert link.startswith(f"{home}/blob/main/"), link
        path, _, anchor = link.removeprefix(f"{home}/blob/main/").partition("#")
        assert (ROOT / path).is_file(), link
        assert not anchor or anchor in anchors(ROOT / path), link


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
