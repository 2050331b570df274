"""The patch framework against real modules imported from disk."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from vllm_xpu_memfix.core.patching import Patch, Patcher, State, vllm_version

SOURCE = textwrap.dedent(
    """
    imported = True

    class Base:
        def load(self, x):
            return ("base", x)

    class Child(Base):
        pass

    def helper(x):
        return x + 1
    """
)


@pytest.fixture
def fake_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Name of a module on disk that is not imported yet."""
    name = f"memfix_fake_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def tagging(tag: str):
    def wrapper(wrapped, instance, args, kwargs):
        return (tag, wrapped(*args, **kwargs))

    return wrapper


def test_patch_waits_for_import_then_applies(fake_module):
    patcher = Patcher()
    patch = Patch("demo", f"{fake_module}:helper", tagging("wrapped"))
    patcher.install(patch)
    assert fake_module not in sys.modules, "installing a patch must not import its module"
    assert patcher.state(patch.key)[0] is State.WAITING

    module = importlib.import_module(fake_module)
    assert patcher.state(patch.key)[0] is State.APPLIED
    assert module.helper(1) == ("wrapped", 2)


def test_patch_applies_at_once_to_an_imported_module(fake_module):
    module = importlib.import_module(fake_module)
    patcher = Patcher()
    patcher.install(Patch("demo", f"{fake_module}:Base.load", tagging("wrapped")))
    assert module.Base().load(3) == ("wrapped", ("base", 3))
    assert module.Child().load(4) == ("wrapped", ("base", 4)), "subclasses inherit the wrapper"


def test_a_target_is_never_wrapped_twice(fake_module):
    module = importlib.import_module(fake_module)
    first, second = Patcher(), Patcher()
    first.install(Patch("demo", f"{fake_module}:helper", tagging("one")))
    first.install(Patch("demo", f"{fake_module}:helper", tagging("again")))
    second.install(Patch("demo", f"{fake_module}:helper", tagging("two")))
    assert module.helper(1) == ("one", 2)
    state, reason = second.state(("demo", f"{fake_module}:helper"))
    assert state is State.SKIPPED and "already wrapped" in reason


def test_missing_attribute_is_skipped_with_one_warning(fake_module, caplog):
    importlib.import_module(fake_module)
    patcher = Patcher()
    target = f"{fake_module}:Base.no_such_method"
    with caplog.at_level(logging.WARNING):
        patcher.install(Patch("demo", target, tagging("x")))
    assert patcher.state(("demo", target))[0] is State.SKIPPED
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert target in warnings[0] and "fix demo skipped" in warnings[0] and "vLLM" in warnings[0]


def test_revert_restores_the_original(fake_module):
    module = importlib.import_module(fake_module)
    original = module.helper
    patcher = Patcher()
    patcher.install(Patch("demo", f"{fake_module}:helper", tagging("wrapped")))
    assert module.helper is not original
    patcher.revert_all()
    assert module.helper is original
    assert patcher.state(("demo", f"{fake_module}:helper"))[0] is State.REVERTED


def test_revert_of_an_inherited_method_leaves_the_subclass_as_it_was(fake_module):
    module = importlib.import_module(fake_module)
    patcher = Patcher()
    target = f"{fake_module}:Child.load"
    patcher.install(Patch("demo", target, tagging("child")))
    assert "load" in vars(module.Child)
    assert module.Child().load(1) == ("child", ("base", 1))
    assert module.Base().load(1) == ("base", 1)
    patcher.revert(("demo", target))
    assert "load" not in vars(module.Child)
    assert module.Child().load(1) == ("base", 1)


def test_patches_of_two_fixes_stack_and_revert_in_reverse(fake_module):
    module = importlib.import_module(fake_module)
    original = module.helper
    patcher = Patcher()
    patcher.install(Patch("inner", f"{fake_module}:helper", tagging("inner")))
    patcher.install(Patch("outer", f"{fake_module}:helper", tagging("outer")))
    assert module.helper(1) == ("outer", ("inner", 2))
    patcher.revert(("inner", f"{fake_module}:helper"))
    assert module.helper(1) == ("outer", ("inner", 2)), "an inner wrapper is not torn out"
    patcher.revert_all()
    assert module.helper is original


def test_once_patch_runs_for_the_first_call_only(fake_module):
    module = importlib.import_module(fake_module)
    calls = []

    def count(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    patcher = Patcher()
    patcher.install(Patch("demo", f"{fake_module}:Base.load", count, once=True))
    obj = module.Base()
    assert obj.load(1) == ("base", 1)
    assert obj.load(2) == ("base", 2)
    assert calls == [(1,)]
    assert "load" in vars(module.Base) and not hasattr(vars(module.Base)["load"], "_self_patch_key")


def test_once_patch_stays_inert_when_a_foreign_wrapper_blocks_its_revert(fake_module):
    """Another library wraps the target from outside after us: revert must refuse, and the
    once-hook must still fire only once (the ledger's table would otherwise print per batch)."""
    import wrapt

    module = importlib.import_module(fake_module)
    calls = []
    patcher = Patcher()

    def count(wrapped, _instance, args, kwargs):
        calls.append(1)
        return wrapped(*args, **kwargs)

    patch = Patch("demo", f"{fake_module}:Base.load", count, once=True)
    patcher.install(patch)
    wrapt.wrap_function_wrapper(module, "Base.load", lambda w, i, a, k: w(*a, **k))
    for x in range(3):
        assert module.Base().load(x) == ("base", x)
    assert calls == [1]
    assert patcher.state(patch.key) == (
        State.APPLIED,
        "not reverted: wrapped again by another patch",
    )


def test_reverting_before_the_import_cancels_the_patch(fake_module):
    patcher = Patcher()
    patch = Patch("demo", f"{fake_module}:helper", tagging("wrapped"))
    patcher.install(patch)
    patcher.revert_all()
    module = importlib.import_module(fake_module)
    assert module.helper(1) == 2, "a reverted patch must not apply when its module is imported"
    assert patcher.state(patch.key)[0] is State.REVERTED


def test_a_patch_whose_module_is_not_in_its_package_says_so_once_at_install(
    tmp_path, monkeypatch, caplog
):
    """A package on disk, imported, that lacks the target's module (vLLM 0.26 has no
    ``entrypoints.launchers``): one DEBUG line at install, nothing imported; its sibling
    that exists stays silent and applies on import."""
    name = f"memfix_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / name / "sub").mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "sub" / "__init__.py").write_text("")
    (tmp_path / name / "sub" / "here.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    absent = Patch("demo", f"{name}.gone.entry:f", tagging("x"), optional=True)
    present = Patch("demo", f"{name}.sub.here:f", tagging("y"), optional=True)
    patcher = Patcher()
    with caplog.at_level(logging.DEBUG, logger="vllm_xpu_memfix"):
        patcher.install_all((absent, present))
    said = [r.getMessage() for r in caplog.records if "will not be patched" in r.getMessage()]
    assert said == [
        f"vllm-xpu-memfix: fix demo: {name}.gone.entry:f will not be patched: module "
        f"{name}.gone.entry is not in vLLM {vllm_version()}"
    ]
    assert f"{name}.sub" not in sys.modules and f"{name}.sub.here" not in sys.modules
    assert patcher.state(absent.key) == (State.WAITING, said[0].rsplit(": ", 1)[1])
    assert importlib.import_module(f"{name}.sub.here").f() == ("y", 1)
    assert patcher.state(present.key) == (State.APPLIED, "")
    for module in [m for m in sys.modules if m.startswith(name)]:
        sys.modules.pop(module)
