"""config.pbtxt parameters parsed from the dataclasses that declare them."""
from __future__ import annotations

import pytest

from zipmoe.engine.engine import EngineConfig
from zipmoe.serving.decoder import DecoderConfig
from zipmoe.settings import SettingsError, check_fields, parse_parameters, settings_of


def test_values_are_typed_and_absent_ones_take_the_dataclass_default():
    engine, service = parse_parameters({"block_size": "32", "cuda_graphs": "False", "sere_threshold": "0.25",
                                        "default_max_tokens": "8"}, EngineConfig, DecoderConfig)
    assert (engine.block_size, engine.cuda_graphs, engine.sere_threshold) == (32, False, 0.25)
    assert engine.max_num_seqs == EngineConfig().max_num_seqs
    assert service == DecoderConfig(default_max_tokens=8)


def test_unknown_parameter_names_the_known_ones():
    with pytest.raises(SettingsError, match=r"moe_decoder/config.pbtxt: unknown parameter\(s\) blocksize; "
                                            r"known: .*block_size"):
        parse_parameters({"blocksize": "16"}, EngineConfig, model="moe_decoder")


@pytest.mark.parametrize("params, message", [
    ({"block_size": "sixteen"}, "block_size='sixteen' is not a valid int"),
    ({"block_size": "0"}, "block_size='0' must be >= 1"),
    ({"cuda_graphs": "yes"}, "must be true or false"),
    ({"routing_policy": "fast"}, "must be one of topk, sere, oea, truncate"),
    ({"dtype": "int8"}, "must be one of auto, float32"),
])
def test_malformed_values_are_refused(params, message):
    with pytest.raises(SettingsError, match=message):
        parse_parameters(params, EngineConfig)


def test_backend_parameters_pass_and_every_setting_has_help():
    (engine,) = parse_parameters({"FORCE_CPU_ONLY_INPUT_TENSORS": "no"}, EngineConfig)
    assert engine == EngineConfig()
    assert all(field.metadata["help"] for field, _ in settings_of(EngineConfig).values())


def test_configs_built_in_code_are_checked_too():
    with pytest.raises(ValueError, match="max_tokens_cap=0 must be >= 1"):
        check_fields(EngineConfig(max_tokens_cap=0))
