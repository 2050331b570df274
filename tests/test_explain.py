"""``vllm-xpu-memfix explain``: every cause and remedy code has an entry, read from the
installed package (a wheel's data, not the repository), and bad input is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_xpu_memfix.cli import explain
from vllm_xpu_memfix.startup import codes

ROOT = Path(__file__).resolve().parent.parent
# vLLM and torch made unimportable: explain must not need them.
NO_VLLM = "import sys; sys.modules['vllm'] = sys.modules['torch'] = None; "


def cli(*argv: str, pythonpath: str = str(ROOT), cwd: Path | None = None):
    code = NO_VLLM + "from vllm_xpu_memfix.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )


def test_the_package_guide_is_the_repository_guide():
    assert explain.guide_text() == (ROOT / "docs" / "troubleshooting.md").read_text()


def test_every_cause_has_its_section_and_every_remedy_a_passage_of_the_guide():
    sections = explain.sections(explain.self_contained(explain.guide_text()))
    for cause in codes.CAUSES:
        assert cause in sections and f"`{cause}`" in sections[cause], cause
        assert explain.entry(cause) == f"{cause} (cause)\n\n{sections[cause]}"
    for remedy in codes.REMEDIES:
        text = explain.entry(remedy)
        assert text is not None and text.startswith(f"{remedy} (remedy): {codes.REMEDIES[remedy]}")
        passages = text.split("\n## ")[1:]
        assert passages and all(f"`{remedy}`" in p for p in passages), remedy


def test_an_entry_ends_at_the_next_anchor_or_heading():
    guide = (
        "# Guide\n\nintro\n\n"
        '<a id="a"></a>\n## A\n\nabout a, `quantize`\n\n'
        '<a id="b"></a>\nb without a heading\n\n## Other\n\nnot b, `quantize`\n'
    )
    assert explain.sections(guide) == {
        "a": "## A\n\nabout a, `quantize`",
        "b": "b without a heading",
    }
    entry = explain.remedy_entry("quantize", guide)
    assert entry.split("\n\n")[1:] == ["## A\nabout a, `quantize`", "## Other\nnot b, `quantize`"]


def test_explain_prints_an_entry_without_vllm():
    result = cli("explain", "quant_staging")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("quant_staging (cause)\n\n## Killed while loading weights")
    assert "`load_slots`" in result.stdout and "<a id" not in result.stdout


def test_a_code_in_capitals_is_the_same_code():
    result = cli("explain", "Quant_Staging")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("quant_staging (cause)\n\n")


def test_an_unknown_code_is_one_line_with_the_nearest_codes_and_exit_2():
    result = cli("explain", "sampler")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "'sampler' is no cause or remedy code" in line
    assert line.split("nearest: ")[1].startswith("sampler_burst")


def test_explain_alone_lists_every_code():
    result = cli("explain")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == [*codes.CAUSES, *codes.REMEDIES]


def test_a_built_wheel_carries_the_guide_and_explains_and_reports_from_it(built_release, tmp_path):
    """The release's wheel, run from the wheel file itself (zipimport): the entry comes from
    the wheel's data through importlib.resources."""
    _, wheel = built_release
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read(f"vllm_xpu_memfix/{explain.GUIDE}").decode()
    assert shipped == explain.guide_text()
    deps = os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))
    where = f"{wheel}{os.pathsep}{deps}"
    imported = subprocess.run(
        [sys.executable, "-c", "import vllm_xpu_memfix as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": where},
    )
    assert imported.stdout.startswith(str(wheel)), imported.stdout
    result = cli("explain", "kv_headroom", pythonpath=where, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    unwrapped = " ".join(result.stdout.split())
    assert unwrapped.startswith(f"kv_headroom (remedy): {codes.REMEDIES['kv_headroom']}")
    reported = cli("report", pythonpath=where, cwd=tmp_path)
    assert reported.returncode == 0, reported.stderr
    assert reported.stdout.startswith("### vllm-xpu-memfix report")
