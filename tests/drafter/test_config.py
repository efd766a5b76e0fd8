"""DSparkConfig: DeepSpec and z-lab DFlash config.json parsing, round trip, validation."""
import pytest

from dspark_serve.drafter.config import DSparkConfig, default_dflash_target_layer_ids


def test_deepspec_round_trip_keeps_every_key(deepspec_dict):
    raw = deepspec_dict()
    cfg = DSparkConfig.from_deepspec_dict(raw)
    assert (cfg.block_size, cfg.gamma, cfg.label_offset) == (7, 7, 0)
    assert cfg.rope_theta == 1e6 and cfg.markov_rank == 4 and cfg.confidence_head_with_markov
    assert cfg.context_dim == 5 * 32
    assert cfg.to_deepspec_dict() == raw
    assert DSparkConfig.from_deepspec_dict(cfg.to_deepspec_dict()) == cfg
    assert not cfg.anchor_context
    ctx = DSparkConfig.from_deepspec_dict({**raw, "anchor_context": True})
    assert ctx.anchor_context and ctx.to_deepspec_dict() == {**raw, "anchor_context": True}


def test_deepspec_optional_keys_follow_deepspec(deepspec_dict):
    """markov_head_type exists only with a Markov head, confidence_head_with_markov only
    with a confidence head (build_draft_config); a legacy top-level rope_theta round-trips."""
    raw = deepspec_dict(markov_rank=0, enable_confidence_head=False, rope_theta=10000.0)
    del raw["markov_head_type"], raw["confidence_head_with_markov"], raw["rope_parameters"]
    cfg = DSparkConfig.from_deepspec_dict(raw)
    assert cfg.markov_rank == 0 and not cfg.enable_confidence_head and cfg.rope_theta == 1e4
    assert cfg.to_deepspec_dict() == raw


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["DFlashDraftModel"]), "architectures"),
    (dict(block_size=None), "block_size"),
    (dict(markov_head_type=None), "markov_head_type"),
    (dict(confidence_head_with_markov=None), "confidence_head_with_markov"),
    (dict(markov_head_type="lstm"), "markov_head_type"),
    (dict(target_layer_ids=[1, 9, 9]), "strictly increasing"),
    (dict(target_layer_ids=[-2, 3]), "outside"),
    (dict(target_layer_ids=[1, 36]), "outside"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(mask_token_id=61), "mask_token_id"),
    (dict(hidden_act="gelu"), "silu"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "full_attention"),
    (dict(rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}), "RoPE"),
    (dict(markov_rank=0, markov_head_type="vanilla"), "confidence_head_with_markov needs"),
])
def test_deepspec_bad_configs_raise(deepspec_dict, change, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_deepspec_dict(deepspec_dict(**change))


def test_dflash_config_nested_keys_and_alignment(dflash_dict):
    raw = dflash_dict()
    cfg = DSparkConfig.from_dflash_dict(raw)
    assert (cfg.block_size, cfg.gamma, cfg.label_offset) == (16, 15, 1)
    assert cfg.target_layer_ids == [1, 17, 33] and cfg.mask_token_id == 60
    assert cfg.markov_rank == 0 and not cfg.enable_confidence_head
    assert cfg.rope_theta == 1e6
    with pytest.raises(ValueError, match="DeepSpec format"):
        cfg.to_deepspec_dict()


def test_dflash_default_target_layers(dflash_dict):
    # The taps DeepSpec's Qwen3-4B configs spell out (36 target layers, 5 draft layers).
    assert default_dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_dflash_target_layer_ids(36, 1) == [18]
    raw = dflash_dict(dflash_config={"mask_token_id": 60})
    assert DSparkConfig.from_dflash_dict(raw).target_layer_ids == [1, 33]


@pytest.mark.parametrize("dflash, message", [
    ({"target_layer_ids": [1, 2]}, "mask_token_id"),
    ({"mask_token_id": 60, "projector_type": "dspark"}, "unsupported DFlash variant"),
    ({"mask_token_id": 60, "markov_rank": 8}, "unsupported DFlash variant"),
])
def test_dflash_bad_configs_raise(dflash_dict, dflash, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_dflash_dict(dflash_dict(dflash_config=dflash))
