"""Every config.pbtxt against the one declaration of each tensor (serving/interface.py) and of each
parameter (serving/model_settings.py), and the client built from the same table."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from zipmoe import serve
from zipmoe.clients import triton_client
from zipmoe.serving.interface import CLIENT_INPUTS, CLIENT_OUTPUTS, DECODER_OPTIONS, KEEP_RATIO_USED, VISUAL_TOKENS
from zipmoe.serving.model_settings import MODEL_SETTINGS
from zipmoe.settings import parse_parameters

REPOSITORY = serve.DEFAULT_REPOSITORY


def config(model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def declared(tensors) -> dict[str, tuple]:
    """name -> (data_type, dims, optional) as config.pbtxt writes them."""
    return {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims), getattr(t, "optional", False))
            for t in tensors}  # outputs have no `optional`


def table(specs, optional: bool | None = None) -> dict[str, tuple]:
    return {s.name: (s.config_type, s.dims, s.optional if optional is None else optional) for s in specs.values()}


@pytest.mark.parametrize("model", ["mm_qa", "mm_qa_bls"])
def test_client_facing_models_declare_exactly_the_interface(model):
    cfg = config(model)
    assert declared(cfg.input) == table(CLIENT_INPUTS)
    assert declared(cfg.output) == table(CLIENT_OUTPUTS, optional=False)


def test_moe_decoder_takes_the_decoder_options_and_visual_tokens_as_declared():
    inputs = declared(config("moe_decoder").input)
    tokens = {**VISUAL_TOKENS, KEEP_RATIO_USED.name: KEEP_RATIO_USED}
    assert {name: inputs[name] for name in DECODER_OPTIONS} == table(DECODER_OPTIONS)
    assert {name: inputs[name] for name in tokens} == table(tokens)
    outputs = declared(config("vision_encoder").output)
    assert {name: outputs[name][:2] for name in tokens} == {k: v[:2] for k, v in table(tokens).items()}
    echoed = declared(config("moe_decoder").output)[KEEP_RATIO_USED.name]
    assert echoed == table(CLIENT_OUTPUTS, optional=False)[KEEP_RATIO_USED.name]


def test_preprocess_and_vision_encoder_take_client_inputs_as_declared():
    pre = declared(config("preprocess").input)
    assert {name: pre[name] for name in ("text_input", "images")} == table(
        {k: CLIENT_INPUTS[k] for k in ("text_input", "images")})
    vision = declared(config("vision_encoder").input)
    for name in ("visual_keep_ratio", "priority"):
        assert vision[name] == table({name: CLIENT_INPUTS[name]})[name]


def test_the_ensemble_hands_every_decoder_option_to_moe_decoder_unchanged():
    steps = {s.model_name: s for s in config("mm_qa").ensemble_scheduling.step}
    assert {k: v for k, v in steps["moe_decoder"].input_map.items() if k in DECODER_OPTIONS} == \
        {name: name for name in DECODER_OPTIONS}
    assert steps["vision_encoder"].input_map["visual_keep_ratio"] == "visual_keep_ratio"
    assert steps["vision_encoder"].input_map["priority"] == "priority"
    # The keep ratio used: vision_encoder -> moe_decoder -> the client.
    used = KEEP_RATIO_USED.name
    assert steps["moe_decoder"].input_map[used] == steps["vision_encoder"].output_map[used]
    assert steps["moe_decoder"].output_map[used] == used


@pytest.mark.parametrize("model", sorted(MODEL_SETTINGS))
def test_every_parameter_is_declared_and_parses(model):
    raw = json_format.MessageToDict(config(model)).get("parameters", {})
    parsed = parse_parameters({k: v["stringValue"] for k, v in raw.items()}, *MODEL_SETTINGS[model], model=model)
    assert len(parsed) == len(MODEL_SETTINGS[model])


def test_every_python_model_has_its_settings_declared():
    python_models = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")
                     if config(p.parent.name).backend == "python"}
    assert python_models == set(MODEL_SETTINGS)


def test_client_arrays_follow_the_table():
    assert triton_client._array("max_tokens", 7).dtype == np.int32
    assert triton_client._array("images", [b"a", b"b"]).shape == (2,)
    assert triton_client._array("random_seed", 3).dtype == np.uint64
    with pytest.raises(ValueError, match="no input 'nope'"):
        triton_client._array("nope", 1)


def test_the_client_refuses_integers_its_tensors_cannot_hold():
    """numpy < 2 would wrap them (max_tokens 2**32 + 3 asked for 3 tokens)."""
    with pytest.raises(ValueError, match=r"max_tokens must be in \[-2147483648, 2147483647\], got 4294967299"):
        triton_client._array("max_tokens", 2**32 + 3)
    with pytest.raises(ValueError, match="random_seed must be in"):
        triton_client._array("random_seed", -1)
    assert triton_client._array("random_seed", 2**64 - 1).tolist() == [2**64 - 1]
