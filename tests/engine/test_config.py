"""EngineConfig rejects unknown modes and out-of-range sizes."""
import pytest

from dspark_serve.engine.config import EngineConfig


def test_defaults():
    c = EngineConfig()
    assert (c.speculative, c.scheduler, c.gamma, c.model, c.dtype, c.quantization,
            c.always_draft) == ("hybrid", "async", None, None, "bfloat16", "none", False)


@pytest.mark.parametrize("kwargs, text", [
    (dict(speculative="eagle"), "speculative must be one of none, dflash, dspark"),
    (dict(scheduler="greedy"), "scheduler must be one of"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(gamma=0), "gamma must be a positive integer"),
    (dict(max_model_len=-5), "max_model_len must be a positive integer"),
    (dict(max_num_seqs=2.0), "max_num_seqs must be a positive integer"),
    (dict(threshold=1.5), "threshold must be in [0, 1]"),
    (dict(quantization="int8"), "quantization must be one of none, int4"),
    (dict(quantization="int4", dtype="float32"), "quantization 'int4' needs dtype bfloat16"),
    (dict(draft_vocab_size=-1), "draft_vocab_size must be an integer >= 0"),
    (dict(draft_vocab_size=True), "draft_vocab_size must be an integer >= 0"),
])
def test_invalid(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(**kwargs)


def test_kv_pool_size():
    """Default: 2048 positions per sequence in whole 64-token pages (no more than the context
    needs), at least one full context; an explicit pool must hold one full context."""
    assert EngineConfig().max_model_len is None and EngineConfig().kv_cache_tokens is None
    assert EngineConfig().kv_pool_tokens(8192) == 16 * 2048
    assert EngineConfig(max_num_seqs=2).kv_pool_tokens(8192) == 8192
    assert EngineConfig(max_num_seqs=128).kv_pool_tokens(16) == 128 * 64
    assert EngineConfig(kv_cache_tokens=5000).kv_pool_tokens(4096) == 5000
    with pytest.raises(ValueError, match="must hold one request"):
        EngineConfig(kv_cache_tokens=1000).kv_pool_tokens(4096)
    with pytest.raises(ValueError, match="kv_cache_tokens must be a positive integer"):
        EngineConfig(kv_cache_tokens=0)
