"""Profiling the embedded engine's target forward: the probe layout over KV-cache slots, the
startup profile, and ``python -m dspark_serve.profiler`` end to end on a tiny random Llama."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_serve.model.kv_cache import KVCache
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.profiler.cli import main
from dspark_serve.profiling.runner import profile_cost_table, target_step
from dspark_serve.profiling.sps import batch_grid


class RecordingModel:
    """Duck-typed target: records the step layout instead of computing."""

    weights = SimpleNamespace(vocab_size=50)

    def __init__(self):
        self.calls = []

    def forward(self, ids, slots, positions, cache, logit_indices):
        cache.check_tokens(slots, positions)
        self.calls.append((ids.tolist(), slots.tolist(), positions.tolist(), logit_indices))


def test_probe_layout():
    cache = KVCache(num_layers=2, num_slots=4, max_len=16, num_kv_heads=1, head_dim=2)
    taken = cache.allocate()  # a running request's slot stays untouched
    model = RecordingModel()
    with target_step(model, cache, max_requests=2) as step:
        assert cache.num_free_slots == 1
        step(5, 8)   # 5 tokens over 2 requests: 3 + 2, after 8 cached positions
        step(1, 3)
    ids, slots, positions, logits = model.calls[0]
    a, b = sorted(set(slots))
    assert taken not in (a, b)
    assert slots == [a, a, a, b, b] and positions == [8, 9, 10, 8, 9]
    assert logits is None and all(0 <= t < 50 for t in ids)  # every token's logits
    assert model.calls[1][1:3] == ([a], [3])
    assert cache.num_free_slots == 3                          # slots returned on exit
    assert bool((cache.k[:, [a, b], :, :8] != 0).all())      # context filled with data


def test_probe_must_fit_the_cache():
    cache = KVCache(num_layers=1, num_slots=2, max_len=8, num_kv_heads=1, head_dim=2)
    with target_step(RecordingModel(), cache) as step:
        with pytest.raises(ValueError, match="max_len 8"):
            step(4, 7)  # 2 tokens per request at positions 7, 8
    assert cache.num_free_slots == 2
    full = KVCache(num_layers=1, num_slots=1, max_len=8, num_kv_heads=1, head_dim=2)
    full.allocate()
    with pytest.raises(ValueError, match="no free slot"):
        with target_step(RecordingModel(), full):
            pass


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_startup_profile(tiny_llama):
    from dspark_serve.model.target_model import TargetModel
    model = TargetModel.from_pretrained(str(tiny_llama))
    cache = model.new_kv_cache(num_slots=4, max_len=40)
    fast = dict(time_budget_s=60.0, warmup=0, repeats=1)
    table = profile_cost_table(model, cache, max_batch_tokens=24, context_len=16,
                               meta={"model": "tiny"}, **fast)
    assert table.sample_batch_tokens == tuple(batch_grid(24, 2)) == (1, 2, 3, 4, 6, 8, 12, 16, 24)
    assert table.max_batch_tokens == 24
    assert table.meta["requests"] == 4 and table.meta["context_len"] == 16
    assert table.meta["model"] == "tiny"
    assert cache.num_free_slots == 4
    # 36 cached positions leave 4 per slot: B = 16 fits 4 slots, B = 24 would need 6
    tight = profile_cost_table(model, cache, max_batch_tokens=24, context_len=36, **fast)
    assert tight.sample_batch_tokens[-1] == 16
    assert tight.max_batch_tokens == 24
    with pytest.raises(ValueError, match="no room"):
        profile_cost_table(model, cache, max_batch_tokens=8, context_len=40)


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_cli_end_to_end(tiny_llama, tmp_path, capsys, keep_threads):
    code = main(["--model", str(tiny_llama), "--max-batch-tokens", "8", "--context-lens", "4,16",
                 "--warmup", "1", "--repeats", "1", "--requests", "2", "--threads", "1",
                 "--out-dir", str(tmp_path)])
    assert code == 0
    json_path, png_path = capsys.readouterr().out.split()
    table = CostTable.load(json_path)
    assert table.sample_batch_tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert table.max_batch_tokens == 8
    meta = table.meta
    assert json_path.endswith(f"{meta['sku']}.json") and png_path.endswith(f"{meta['sku']}.png")
    assert (meta["model"], meta["dtype"], meta["quantization"], meta["context_len"]) == (
        "tiny-llama", "bfloat16", "none", 16)
    assert meta["profile"]["context_lens"] == [4, 16]
    assert {"device", "torch", "cuda", "date"} <= set(meta)
    assert meta["cpu_threads"] == 1 and meta["sku"].endswith("_1c")


def test_cli_rejects_unprofiled_table_context(tiny_llama, tmp_path):
    assert main(["--model", str(tiny_llama), "--context-lens", "4,16",
                 "--table-context-len", "8", "--out-dir", str(tmp_path)]) == 2
