"""The helper models' MPS client settings: which variables, set before CUDA, an operator's kept."""
import os

import pytest

from zipmoe.serving import gpu_share
from zipmoe.serving.gpu_share import GpuShareConfig
from zipmoe.settings import SettingsError, parse_parameters

VARIABLES = ("CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_ask_for_below_normal_priority_and_no_cap():
    assert gpu_share.mps_environment(GpuShareConfig()) == {"CUDA_MPS_CLIENT_PRIORITY": "1"}


def test_parameters_parse_into_the_environment():
    (config,) = parse_parameters({"mps_client_priority": "normal", "mps_active_thread_percentage": "60"},
                                 GpuShareConfig)
    assert gpu_share.mps_environment(config) == {"CUDA_MPS_CLIENT_PRIORITY": "0",
                                                 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}


@pytest.mark.parametrize("params", [{"mps_client_priority": "high"}, {"mps_active_thread_percentage": "101"},
                                    {"mps_active_thread_percentage": "-1"}])
def test_bad_values_are_refused(params):
    with pytest.raises(SettingsError):
        parse_parameters(params, GpuShareConfig)


def test_apply_before_cuda_sets_the_variables_quietly(clean_env):
    assert gpu_share.apply(GpuShareConfig(mps_active_thread_percentage=50), initialised=lambda: False) is None
    assert os.environ["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_apply_after_cuda_warns(clean_env):
    warning = gpu_share.apply(GpuShareConfig(), initialised=lambda: True)
    assert "CUDA_MPS_CLIENT_PRIORITY" in warning and "may not apply" in warning


def test_the_operators_own_variables_win(clean_env, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "0")
    assert gpu_share.apply(GpuShareConfig(), initialised=lambda: True) is None  # nothing of ours to warn about
    assert os.environ["CUDA_MPS_CLIENT_PRIORITY"] == "0"


def test_driver_probe_answers_on_this_machine():
    # Without a CUDA driver: None; with one: whether this test process already initialised it.
    assert gpu_share._driver_initialised() in (None, True, False)
