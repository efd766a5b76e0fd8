"""SamplingParams.validate: every range check names the field and gives OpenAI-style text."""
import math

import pytest

from dspark_serve.engine.params import InvalidParameter, SamplingParams

V = 1000


def test_defaults_are_valid():
    p = SamplingParams()
    p.validate(V)
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, 0)


def test_top_k_minus_one_means_off():
    p = SamplingParams(top_k=-1)
    p.validate(V)
    assert p.top_k == 0


@pytest.mark.parametrize("kwargs", [
    dict(n=16), dict(max_tokens=1), dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1e-6),
    dict(min_p=1.0), dict(frequency_penalty=-2.0), dict(presence_penalty=2.0),
    dict(repetition_penalty=1e-3), dict(logit_bias={0: -100.0, V - 1: 100}), dict(seed=-(2 ** 63)),
    dict(stop=["\n"], stop_token_ids=[V - 1]), dict(logprobs=True, top_logprobs=20),
])
def test_boundary_values_accepted(kwargs):
    SamplingParams(**kwargs).validate(V)


@pytest.mark.parametrize("kwargs, param, text", [
    (dict(n=0), "n", "Expected a value >= 1, but got 0 instead"),
    (dict(n=17), "n", "Expected a value <= 16, but got 17 instead"),
    (dict(max_tokens=0), "max_tokens", "integer below minimum value"),
    (dict(max_tokens=True), "max_tokens", "expected an integer, but got bool"),
    (dict(temperature=-0.1), "temperature", "decimal below minimum value"),
    (dict(temperature=2.5), "temperature", "Expected a value <= 2"),
    (dict(temperature=math.nan), "temperature", "got nan"),
    (dict(top_p=0.0), "top_p", "Expected a value > 0"),
    (dict(top_p=1.5), "top_p", "Expected a value <= 1"),
    (dict(top_k=-2), "top_k", "Expected a value >= 0"),
    (dict(min_p=-0.1), "min_p", "below minimum"),
    (dict(frequency_penalty=2.1), "frequency_penalty", "above maximum"),
    (dict(presence_penalty=-3), "presence_penalty", "below minimum"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "Expected a value > 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty", "to be finite"),
    (dict(seed=2 ** 63), "seed", "above maximum"),
    (dict(stop=[""]), "stop", "non-empty string"),
    (dict(stop_token_ids=[V]), "stop_token_ids", f"[0, {V})"),
    (dict(logit_bias={V: 1.0}), "logit_bias", f"Invalid key in 'logit_bias': {V}"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "Invalid key in 'logit_bias': -1"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "Invalid key in 'logit_bias': '5'"),
    (dict(logit_bias={5: 101.0}), "logit_bias", "Expected a value <= 100"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "Expected a value <= 20"),
    (dict(top_logprobs=3), "top_logprobs", "requires 'logprobs'"),
])
def test_invalid_values_rejected(kwargs, param, text):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs).validate(V)
    assert info.value.param == param
    assert text in str(info.value)
    assert isinstance(info.value, ValueError)
