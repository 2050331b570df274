"""The README documents every switch the code reads, with its values and default."""

from pathlib import Path

from vllm_xpu_memfix.core import config

README = (Path(__file__).parent.parent / "README.md").read_text()


def _switch_table() -> list[str]:
    """The lines of the one table under the README's "## Switches" heading."""
    section = README.split("\n## Switches\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variable"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def _row(variable: str) -> list[str]:
    for line in _switch_table():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == f"`{variable}`":
            return cells
    raise AssertionError(f"{variable} has no row in the README switch table")


def test_every_variable_has_a_row_with_its_default_and_values():
    for variable in config.VARIABLES:
        _name, values, default, effect = _row(variable.name)
        expected_default = f"`{variable.default}`" if variable.default else "unset"
        assert default.startswith(expected_default), variable.name
        for value in variable.choices:
            assert f"`{value}`" in values, (variable.name, value)
        if variable.bounds is not None:
            assert values.startswith(variable.bounds.accepted), (variable.name, values)
        assert values and effect


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_test_one():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert ci.strip().splitlines()[-1] == "make test"
