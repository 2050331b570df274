import pytest

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode
from vllm_xpu_memfix.core.numbers import ConfigError


def test_defaults_enable_every_fix_in_auto_mode():
    settings = config.load({})
    assert settings.enabled
    assert {key: mode for key, mode in settings.modes.items()} == {
        f.key: Mode.AUTO for f in config.FIXES
    }
    assert all(settings.requested(f) for f in config.FIXES)


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_master_switch_off(value):
    settings = config.load({"VLLM_XPU_MEMFIX": value})
    assert not settings.enabled
    assert not any(settings.requested(f) for f in config.FIXES)


def test_fix_switch_values_are_case_insensitive():
    settings = config.load({"VLLM_XPU_MEMFIX_LEDGER": "OFF"})
    assert settings.mode(config.LEDGER) is Mode.OFF
    assert not settings.requested(config.LEDGER)
    assert config.load({"VLLM_XPU_MEMFIX_LEDGER": "On"}).mode(config.LEDGER) is Mode.ON


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


def test_every_settings_field_is_read_from_exactly_one_variable():
    """Settings has no defaults of its own: each field comes from one row's parser."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config.Settings)}
    rows = [v.field for v in config.VARIABLES if v.field != "modes"]
    assert len(rows) == len(set(rows))
    assert fields == {*rows, "modes"}
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(config.Settings))


def test_each_default_parses_to_the_value_an_empty_environment_gives():
    defaults = config.load({})
    for variable in config.PARAMETERS:
        value = variable.parse(variable, variable.default, {})
        assert getattr(defaults, variable.field) == value, variable.name
        assert getattr(config.load({variable.name: variable.default}), variable.field) == value


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "soon"])
def test_non_finite_or_non_positive_timeouts_are_refused(value):
    with pytest.raises(ConfigError, match="VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S"):
        config.load({"VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S": value})


def test_driver_env_takes_no_peer_access_and_the_other_switches_do_not():
    settings = config.load({"VLLM_XPU_MEMFIX_DRIVER_ENV": " No_Peer_Access "})
    assert settings.mode(config.DRIVER_ENV) is Mode.NO_PEER_ACCESS
    assert settings.requested(config.DRIVER_ENV)
    with pytest.raises(ConfigError) as err:
        config.load({"VLLM_XPU_MEMFIX_LEDGER": "no_peer_access"})
    assert str(err.value) == (
        "VLLM_XPU_MEMFIX_LEDGER='no_peer_access' is not valid; accepted values: auto, on, off"
    )
    with pytest.raises(ConfigError) as err:
        config.load({"VLLM_XPU_MEMFIX_DRIVER_ENV": "p2p_off"})
    assert str(err.value) == (
        "VLLM_XPU_MEMFIX_DRIVER_ENV='p2p_off' is not valid; accepted values: auto, on, off, "
        "no_peer_access"
    )


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_value_means_unset_for_every_switch(value):
    """docker-compose's ``${X}`` of an unset X gives "": every switch (and path) then takes
    its default, never an error (VLLM_XPU_MEMFIX_PREFLIGHT= used to stop vLLM)."""
    defaults = config.load({})
    for variable in (config.MASTER, *config.SWITCHES.values()):
        assert config.load({variable.name: value}) == defaults, variable.name
    assert config.load({config.PREFLIGHT.env: value}).mode(config.PREFLIGHT) is Mode.AUTO
