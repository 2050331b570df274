import pytest

from vllm_xpu_memfix import config
from vllm_xpu_memfix.config import ConfigError, Mode


def test_defaults_enable_every_fix_in_auto_mode():
    settings = config.load({})
    assert settings.enabled
    assert {key: mode for key, mode in settings.modes.items()} == {
        f.key: Mode.AUTO for f in config.FIXES
    }
    assert all(settings.requested(f.key) for f in config.FIXES)


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_master_switch_off(value):
    settings = config.load({"VLLM_XPU_MEMFIX": value})
    assert not settings.enabled
    assert not any(settings.requested(f.key) for f in config.FIXES)


def test_fix_switch_values_are_case_insensitive():
    settings = config.load({"VLLM_XPU_MEMFIX_LEDGER": "OFF"})
    assert settings.mode("ledger") is Mode.OFF
    assert not settings.requested("ledger")
    assert config.load({"VLLM_XPU_MEMFIX_LEDGER": "On"}).mode("ledger") is Mode.ON


def test_invalid_fix_value_names_variable_value_and_accepted_values():
    with pytest.raises(ConfigError) as err:
        config.load({"VLLM_XPU_MEMFIX_LEDGER": "maybe"})
    message = str(err.value)
    assert "VLLM_XPU_MEMFIX_LEDGER" in message
    assert "'maybe'" in message
    assert "auto, on, off" in message


def test_invalid_master_value_is_refused():
    with pytest.raises(ConfigError, match=r"VLLM_XPU_MEMFIX='2'.*accepted values: 1, on"):
        config.load({"VLLM_XPU_MEMFIX": "2"})


def test_variable_table_covers_master_and_every_fix():
    names = [v.name for v in config.VARIABLES]
    assert names[0] == "VLLM_XPU_MEMFIX"
    assert {f.env for f in config.FIXES} <= set(names)
    assert len(names) == len(set(names))
