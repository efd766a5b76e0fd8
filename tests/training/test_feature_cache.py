"""The target feature cache: cached taps, final hidden states, lse and greedy tokens equal the
target's own forward computed on the fly (tiny float32 target; the cache stores bf16, so taps
and f_t are compared after the same bf16 rounding, exactly), and an interrupted build resumes
to the same cache."""
import torch
import torch.nn.functional as F

from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.cache_features import build_cache
from dspark_serve.training.feature_cache import (FeatureCache, head_lse_greedy, target_logits_rows,
                                                 write_meta)
from dspark_serve.training.feature_sources import generated_sequences

from .conftest import LAYERS, TAPS, make_target


def _tapped_target() -> TargetModel:
    base = make_target()
    return TargetModel(base.weights, base.config, target_layer_ids=TAPS + [LAYERS - 1])


def _build(folder, data, **kw):
    write_meta(folder, hidden_size=32, target_layer_ids=TAPS, model="tiny")
    return build_cache(_tapped_target(), generated_sequences(data, max_len=64), folder,
                       batch_tokens=60, shard_tokens=70, **kw)


def test_cached_features_equal_the_forward_on_the_fly(tmp_path, write_sequences):
    write_sequences(tmp_path / "data", n=6)
    added = _build(tmp_path / "cache", tmp_path / "data")
    cache = FeatureCache(tmp_path / "cache")
    assert len(cache) == 6 and added == cache.num_tokens == 6 * 25
    assert len(list((tmp_path / "cache").glob("shard-*.pt"))) == 2   # 3 sequences per shard
    target = make_target()
    for i in range(len(cache)):
        seq = cache[i]
        assert seq.key == f"gen:data:{i}"
        # one target per sequence, alone (the cache prefilled several sequences together)
        t = seq.ids.numel()
        kv = target.new_kv_cache(1, t)
        slot = kv.allocate()
        out = target.forward(seq.ids, torch.full((t,), slot), torch.arange(t), kv)
        assert torch.equal(seq.taps, out.taps.to(torch.bfloat16))
        w = target.weights
        ref_taps = TargetModel(w, target.config, target_layer_ids=[LAYERS - 1])
        kv2 = ref_taps.new_kv_cache(1, t)
        slot2 = kv2.allocate()
        last = ref_taps.forward(seq.ids, torch.full((t,), slot2), torch.arange(t), kv2).taps
        final = F.rms_norm(last, (32,), w.final_norm, w.eps)
        assert torch.equal(seq.final, final.to(torch.bfloat16))
        # lse/greedy of the bf16 f_t in float32, against the float32 logits of the forward:
        # the only difference is f_t's bf16 rounding (relative 2^-8 of logits ~|10|)
        assert torch.allclose(seq.lse, torch.logsumexp(out.logits, -1), atol=0.15)
        logits = target_logits_rows(seq.final, target.lm_head.weight)
        assert torch.equal(seq.greedy, logits.argmax(-1))
        # the 64 largest logits are float32 (here all V = 64 of them): agree to float32 rounding
        assert torch.allclose(seq.lse, torch.logsumexp(logits, -1), atol=1e-5)
        top2 = out.logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.3
        assert torch.equal(seq.greedy[clear], out.logits.argmax(-1)[clear])
        assert seq.loss_mask.tolist() == [False] * 5 + [True] * 20


def test_interrupted_build_resumes_to_the_same_cache(tmp_path, write_sequences):
    write_sequences(tmp_path / "data", n=6)
    _build(tmp_path / "one", tmp_path / "data")
    first = _build(tmp_path / "two", tmp_path / "data", max_tokens=60)
    assert first == 75 and len(FeatureCache(tmp_path / "two")) == 3
    second = _build(tmp_path / "two", tmp_path / "data")
    assert second == 75
    one, two = FeatureCache(tmp_path / "one"), FeatureCache(tmp_path / "two")
    assert [one[i].key for i in range(6)] == [two[i].key for i in range(6)]
    for i in range(6):
        assert torch.equal(one[i].taps, two[i].taps) and torch.equal(one[i].final, two[i].final)
        assert torch.equal(one[i].lse, two[i].lse) and torch.equal(one[i].greedy, two[i].greedy)
    assert _build(tmp_path / "two", tmp_path / "data") == 0


def test_lse_tail_in_bf16_stays_within_its_bound():
    # V = 1000 > 64: the tail beyond the 64 largest logits comes from the bf16 product
    g = torch.Generator().manual_seed(0)
    head = torch.randn(1000, 32, generator=g)
    final = (0.5 * torch.randn(300, 32, generator=g)).to(torch.bfloat16)
    lse, greedy = head_lse_greedy(final, head)
    exact = target_logits_rows(final, head)
    assert torch.equal(greedy, exact.argmax(-1))
    ref = torch.logsumexp(exact, -1)
    top = exact.topk(64, -1).values
    tail_share = 1 - torch.exp(torch.logsumexp(top, -1) - ref)
    # each tail logit is off by at most 2^-8 of its size: so is the tail's mass, relatively
    # (plus float32 rounding of the sum)
    bound = tail_share * (torch.exp(exact.abs().max(-1).values * 2.0 ** -8) - 1) + \
        4 * torch.finfo(torch.float32).eps * ref.abs()
    assert bool(((lse - ref).abs() <= bound).all())
    assert float(tail_share.max()) > 0.1          # the tail matters in this test
