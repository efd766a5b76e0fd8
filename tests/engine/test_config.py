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
