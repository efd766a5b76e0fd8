import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dspark_serve.bench import step_profile
from dspark_serve.model.target_model import TargetModel


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return TargetModel.from_hf(AutoModelForCausalLM.from_config(config).eval())


def test_step_inputs_spread_tokens_over_requests():
    ids, slots, positions = step_profile.step_inputs(7, 3, context=10, vocab_size=64)
    assert slots.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert positions.tolist() == [10, 11, 12, 10, 11, 12, 10]
    assert ids.shape == (7,) and int(ids.max()) < 64


def test_step_times_and_table():
    records = step_profile.step_times(tiny_model(), [1, 4], context=20, tokens_per_request=2,
                                      repeats=3)
    assert [r["B"] for r in records] == [1, 4]
    for r in records:
        assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] and r["cpu_ms"] > 0
    table = step_profile.format_step_table(records).splitlines()
    assert table[0].split() == ["B", "median", "ms", "p10", "ms", "p90", "ms", "cpu", "ms",
                                "tokens/s"]
    assert [line.split()[0] for line in table[1:]] == ["1", "4"]


def test_filled_cache_is_allocated_and_finite():
    cache = step_profile.filled_cache(tiny_model(), 3, 16)
    assert cache.num_free_slots == 0 and bool(torch.isfinite(cache.k).all())
    assert float(cache.v.abs().max()) > 0


def test_decode_speed_and_profile():
    model = tiny_model()
    assert step_profile.greedy_tokens_per_s(model, prompt_len=8, new_tokens=4) > 0
    assert "Self CPU" in step_profile.profile_step(model, 2, context=8, steps=1)


def test_parser_defaults():
    parser = argparse.ArgumentParser()
    step_profile.add_parser(parser.add_subparsers())
    args = parser.parse_args(["step", "--batch-tokens", "1,8", "--threads", "1"])
    assert args.batch_tokens == [1, 8] and args.dtype == "bfloat16" and args.func is step_profile.main
