"""Every fix has the one shape described in vllm_xpu_memfix/fixes/__init__.py, and every
patch can be applied and reverted against the installed vLLM."""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.patching import Patcher, RemoveWhen, State, _PatchWrapper

SECTIONS = ("Problem", "Mechanism", "Targets", "Switch", "Upstream", "Remove when")
FIX_IDS = [module.FIX.key for module in fixes.MODULES]


def section(module, name: str) -> str:
    """The text of one section of the fix's docstring record, whitespace collapsed."""
    doc = inspect.getdoc(module) or ""
    pattern = rf"^{name}\n(.*?)(?=^(?:{'|'.join(SECTIONS)})\n|\Z)"
    match = re.search(pattern, doc, flags=re.S | re.M)
    assert match, f"{module.__name__} has no {name!r} section"
    return " ".join(match.group(1).split())


def test_config_and_the_fix_modules_name_the_same_fixes_in_one_order_of_rows():
    assert {m.FIX for m in fixes.MODULES} == set(config.FIXES)
    assert len(fixes.MODULES) == len(config.FIXES)


@pytest.mark.parametrize("module", fixes.MODULES, ids=FIX_IDS)
def test_each_fix_has_the_record_the_metadata_and_the_two_functions(module):
    for name in SECTIONS:
        assert section(module, name)
    assert isinstance(module.REMOVE_WHEN, RemoveWhen)
    assert callable(module.patches) and callable(module.install)
    assert module.FIX.env in section(module, "Switch")


@pytest.mark.parametrize("module", fixes.MODULES, ids=FIX_IDS)
def test_the_targets_section_lists_exactly_the_patches(module):
    listed = set(re.findall(r"``([\w.]+:[\w.]+)``", section(module, "Targets")))
    patched = {p.target for p in module.patches(config.load({}))}
    assert listed == patched


@pytest.mark.parametrize("module", fixes.MODULES, ids=FIX_IDS)
def test_no_fix_keeps_state_in_module_globals(module):
    tree = ast.parse(inspect.getsource(module))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]


def test_remove_when_reads_the_upstream_source():
    rule = RemoveWhen("upstream trims", "vllm.x", ("malloc_trim",))
    assert rule.evaluate(lambda _m: "libc.malloc_trim(0)") == "landed ('malloc_trim' in vllm.x)"
    assert rule.evaluate(lambda _m: "pass") == "not yet upstream"
    assert rule.evaluate(lambda _m: None) == "vllm.x absent"
    assert "outside vLLM" in RemoveWhen("driver").evaluate(lambda _m: "")


def test_every_patch_applies_and_reverts_to_the_identical_original():
    """Against the installed vLLM: applied, the target is our wrapper; reverted, the very
    object that was there before is back (inherited methods: the subclass inherits again).
    A target module that is absent here keeps its patch waiting for the import; a target
    the module lacks (the sym_int4 replay's layout has no such function), or a platform
    worker's copy of a Worker method it inherits, is skipped."""
    pytest.importorskip("vllm")
    patches = fixes.all_patches()
    before = {}
    missing = set()
    for patch in patches:
        try:
            module = importlib.import_module(patch.module)
        except ImportError:
            continue
        parent_path, _, attribute = patch.attr_path.rpartition(".")
        parent = module
        for part in filter(None, parent_path.split(".")):
            parent = getattr(parent, part)
        if not hasattr(parent, attribute):
            missing.add(patch.key)
            continue
        own = attribute in vars(parent)
        if patch.own_only and not own:  # a platform worker inheriting the Worker method
            missing.add(patch.key)
            continue
        before[patch.key] = (parent, attribute, getattr(parent, attribute), own)

    patcher = Patcher()
    for patch in patches:
        patcher.install(patch)
    try:
        for patch in patches:
            state, reason = patcher.state(patch.key)
            if patch.key in missing:
                assert state is State.SKIPPED, (patch.target, state)
                continue
            if patch.key not in before:
                assert state is State.WAITING, (patch.target, state)
                continue
            parent, attribute, _original, _own = before[patch.key]
            assert state is State.APPLIED, (patch.target, reason)
            assert isinstance(vars(parent)[attribute], _PatchWrapper), patch.target
    finally:
        patcher.revert_all()
    for key, (parent, attribute, original, own) in before.items():
        assert patcher.state(key)[0] is State.REVERTED, key
        assert (attribute in vars(parent)) is own, key
        assert getattr(parent, attribute) is original, key
