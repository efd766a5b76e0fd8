"""The cached-feature trainer: the shared-context forward equals the per-block packed forward
(full and pruned vocabulary), draft-space loss terms equal hand-computed values, cached targets
equal the target's own distribution, held-out acceptance counts what it says, and a resumed run
continues exactly. Nothing here trains for real (a few steps of a tiny model)."""
import json
import math
import shutil

import pytest
import torch

from dspark_serve.drafter.checkpoint import load_drafter, save_drafter
from dspark_serve.drafter.config import DSparkConfig
from dspark_serve.drafter.draft_vocab import d2t_from_ids, pruned_lm_head
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.anchors import block_layout
from dspark_serve.training.cache_batch import draft_index_map, sequence_targets
from dspark_serve.training.cache_features import build_cache
from dspark_serve.training.cache_trainer import CacheTrainConfig, train_cached
from dspark_serve.training.draft_space_loss import draft_space_loss
from dspark_serve.training.feature_cache import FeatureCache, write_meta
from dspark_serve.training.feature_sources import generated_sequences
from dspark_serve.training.forward import drafter_forward
from dspark_serve.training.heldout_accept import heldout_acceptance
from dspark_serve.training.models import init_weights
from dspark_serve.training.shared_context import fold_tap_scale, shared_context_forward

from .conftest import LAYERS, TAPS, VOCAB, make_target

KEEP = torch.tensor([0, 1, 3, 4, 9, 17, 25, 26, 40, 59, 60, 63])


def _pruned_twin(full: DSparkDrafter, target, keep: torch.Tensor) -> DSparkDrafter:
    """The same drafter with its output vocabulary cut to ``keep``."""
    cfg = DSparkConfig(**{**full.config.__dict__, "draft_vocab_size": int(keep.numel())})
    pruned = DSparkDrafter(cfg, target.embed_tokens, pruned_lm_head(target.lm_head.weight, keep))
    state = dict(full.state_dict())
    state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][keep]
    state["d2t"] = d2t_from_ids(keep)
    pruned.load_state_dict(state)
    return pruned


def _perturbed(make_drafter, target):
    drafter = make_drafter(target, "dspark", seed=1)
    with torch.no_grad():  # every part off its init so each matters
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    return drafter


def _tap_features(target, ids):
    cache = target.new_kv_cache(1, ids.numel())
    slot = cache.allocate()
    out = target.forward(ids, torch.full_like(ids, slot), torch.arange(ids.numel()), cache)
    return out.taps.clone(), out.logits.clone()


def test_shared_context_forward_equals_the_per_block_forward(target, make_drafter):
    drafter = _perturbed(make_drafter, target)
    ids = torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(30) >= 4
    anchors = torch.tensor([4, 5, 9, 17, 26, 28])
    taps, _ = _tap_features(target, ids)
    lay = block_layout([ids], [mask], [anchors], block_size=4, label_offset=0, mask_token_id=1)
    ref_logits, ref_conf = drafter_forward(drafter, taps[None], lay)
    for chunk in (1, 4, 64):   # chunking over anchors changes nothing
        logits, conf, prev = shared_context_forward(drafter, taps, ids, anchors, chunk=chunk)
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(conf, ref_conf, atol=2e-5, rtol=1e-5)
    # x_{k-1}: the anchor, then the text (anchor 28 of 30 tokens: 0 past the end)
    assert prev[0].tolist() == ids[4:8].tolist()
    assert prev[5].tolist() == [int(ids[28]), int(ids[29]), 0, 0]
    pruned = _pruned_twin(drafter, target, KEEP)
    p_logits, p_conf, _ = shared_context_forward(pruned, taps, ids, anchors)
    torch.testing.assert_close(p_logits, ref_logits[..., KEEP], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(p_conf, ref_conf, atol=2e-5, rtol=1e-5)
    # a tap scale trained in and folded into fc gives the same function
    scale = torch.rand(taps.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5
    scaled, _, _ = shared_context_forward(pruned, taps, ids, anchors, tap_scale=scale)
    fold_tap_scale(pruned, scale)
    folded, _, _ = shared_context_forward(pruned, taps, ids, anchors)
    torch.testing.assert_close(folded, scaled, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="anchors"):
        shared_context_forward(drafter, taps, ids, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="anchors"):
        shared_context_forward(drafter, taps, ids, torch.tensor([9, 5]))


def test_draft_space_loss_equals_hand_computed_values():
    # one block, gamma 2, N = 3 draft tokens of a larger target vocabulary
    logits = torch.tensor([[[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])   # p_d = .5 .25 .25
    p_t = torch.tensor([[[0.4, 0.3, 0.1], [0.2, 0.2, 0.2]]])                 # outside .2, .4
    greedy = torch.tensor([[0, -1]])                  # position 2: target's token is outside
    mask = torch.tensor([[True, True]])
    conf = torch.tensor([[0.0, math.log(3.0)]])      # c = .5, .75
    terms, match = draft_space_loss(logits, p_t, greedy, mask, conf_logits=conf,
                                    alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0, decay=2.0)
    w2 = math.exp(-0.5)
    # |p_d - p_t| on the draft tokens, plus the target mass outside them: 0.5, 0.8
    l1 = [0.1 + 0.05 + 0.15 + 0.2, 3 * (1 / 3 - 0.2) + 0.4]
    c_star = [0.75, 0.6]
    ce = -math.log(0.5)                                # position 2 has no CE label in draft space
    tv = (l1[0] + w2 * l1[1]) / (1 + w2)
    bce = [-(c_star[0] * math.log(0.5) + (1 - c_star[0]) * math.log(0.5)),
           -(c_star[1] * math.log(0.75) + (1 - c_star[1]) * math.log(0.25))]
    conf_loss = (bce[0] + w2 * bce[1]) / (1 + w2)
    assert float(terms.ce) == pytest.approx(ce, rel=1e-6)
    assert float(terms.tv) == pytest.approx(tv, rel=1e-6)
    assert float(terms.conf) == pytest.approx(conf_loss, rel=1e-6)
    assert float(terms.total) == pytest.approx(0.1 * ce + 0.9 * tv + conf_loss, rel=1e-6)
    assert terms.accept.tolist() == pytest.approx(c_star)
    assert terms.expected_tau == pytest.approx(1 + 0.75 + 0.75 * 0.6)
    assert match.tolist() == [[True, False]]
    # a step split in calls: a shared normaliser sums to the whole-batch average
    half, _ = draft_space_loss(logits, p_t, greedy, mask, decay=2.0,
                               normalizer=torch.tensor(2.0 * (1 + w2)))
    assert float(half.tv) == pytest.approx(tv / 2, rel=1e-6)


def _cache(tmp_path, write_sequences, n=6, name="cache"):
    write_sequences(tmp_path / "data", n=n)
    base = make_target()
    tapped = TargetModel(base.weights, base.config, target_layer_ids=TAPS + [LAYERS - 1])
    write_meta(tmp_path / name, hidden_size=32, target_layer_ids=TAPS, model="tiny")
    build_cache(tapped, generated_sequences(tmp_path / "data", max_len=64), tmp_path / name)
    return FeatureCache(tmp_path / name)


def test_cached_targets_are_the_target_distribution_in_draft_space(tmp_path, target,
                                                                   write_sequences):
    cache = _cache(tmp_path, write_sequences, n=2)
    seq = cache[1]
    anchors = torch.tensor([5, 10, 22])
    tg = sequence_targets(seq, anchors, block_size=4, label_offset=0,
                          head_rows=target.lm_head.weight[KEEP],
                          to_draft=draft_index_map(KEEP, VOCAB))
    # the float32 target on the bf16-cached final state: log p_t at the kept ids, exactly
    # normalised over all V (the outside mass is what the kept ids miss)
    final = seq.final.float() @ target.lm_head.weight.T
    full = torch.log_softmax(final, -1)
    # anchor 22 of 25 tokens: labels 23, 24 exist, 25 and 26 do not
    assert tg.label_mask.tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    m = tg.label_mask
    index = (anchors[:, None] + torch.arange(4))[m]        # p + k - 1 of supervised drafts
    torch.testing.assert_close(tg.target_probs[m], full[index][:, KEEP].exp(), atol=1e-6, rtol=1e-5)
    outside = 1 - tg.target_probs[m].sum(-1)
    ref_out = full.exp()[index][:, [v for v in range(VOCAB) if v not in KEEP]].sum(-1)
    torch.testing.assert_close(outside, ref_out, atol=1e-5, rtol=1e-4)
    assert float(ref_out.max()) > 0.05                     # the outside mass is not negligible
    greedy = seq.greedy[index]
    expected = torch.where(torch.isin(greedy, KEEP),
                           torch.searchsorted(KEEP, greedy), torch.tensor(-1))
    assert torch.equal(tg.greedy[m], expected)


def test_heldout_acceptance_counts_exact_greedy_matches(tmp_path, target, make_drafter,
                                                        write_sequences):
    cache = _cache(tmp_path, write_sequences, n=3)
    drafter = _pruned_twin(_perturbed(make_drafter, target), target, KEEP)
    res = heldout_acceptance(drafter, cache, autocast=False)
    hits, n, chains = 0, 0, []
    for i in range(3):
        seq = cache[i]
        anchors = torch.arange(5, 24)                      # response 5..24: p and p + 1 inside
        logits, _, _ = shared_context_forward(drafter, seq.taps, seq.ids, anchors)
        draft = KEEP[logits.argmax(-1)]
        lay = block_layout([seq.ids], [seq.loss_mask], [anchors], block_size=4,
                           label_offset=0, mask_token_id=1)
        ok = (draft == seq.greedy[lay.target_index]) & lay.label_mask
        hits += int(ok[:, 0].sum())
        n += anchors.numel()
        chains.append(1 + ok.long().cumprod(1).sum(1))
    assert res["anchors"] == n == 57 and res["sequences"] == 3
    assert res["pos1"] == pytest.approx(hits / n)
    assert res["tau"] == pytest.approx(float(torch.cat(chains).float().mean()))


def _init_folder(tmp_path, target, make_drafter):
    drafter = _pruned_twin(make_drafter(target, "dspark", seed=0), target, KEEP)
    init_weights(drafter, 0)
    drafter.d2t.copy_(d2t_from_ids(KEEP))
    save_drafter(drafter, tmp_path / "init")
    return str(tmp_path / "init")


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_cached_training_resumes_exactly_and_saves_a_pruned_drafter(tmp_path, target,
                                                                    make_drafter,
                                                                    write_sequences):
    cache = _cache(tmp_path, write_sequences)
    init = _init_folder(tmp_path, target, make_drafter)

    def cfg(out, **kw):
        return CacheTrainConfig(cache=[str(cache.folder)], out=str(tmp_path / out),
                                init_from=init, eval_cache=str(cache.folder), steps=6,
                                seqs_per_step=2, anchors_per_seq=8, lr=3e-3, save_every=2,
                                log_every=1, eval_every=3, eval_seqs=2, tap_norm=True, **kw)

    train_cached(cfg("a"), target=target, log_fn=lambda m: None)
    train_cached(cfg("b"), target=target, log_fn=lambda m: None)
    # interrupted after step 4's checkpoint: drop what came later and run again
    shutil.rmtree(tmp_path / "b" / "step-000006")
    shutil.rmtree(tmp_path / "b" / "final")
    lines = (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()[:4]
    (tmp_path / "b" / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    train_cached(cfg("b"), target=target, log_fn=lambda m: None)
    a, b = _log(tmp_path / "a"), _log(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["blocks"] == rb["blocks"]
    fa = load_drafter(tmp_path / "a" / "final", target.embed_tokens, target.lm_head)
    fb = load_drafter(tmp_path / "b" / "final", target.embed_tokens, target.lm_head)
    for (name, pa), pb in zip(fa.state_dict().items(), fb.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert fa.config.draft_vocab_size == 12 and torch.equal(fa.draft_vocab, KEEP)
    assert {p.dtype for p in fa.parameters()} == {torch.bfloat16}
    # the learning curve: step 0, every 3 steps, and the end
    evals = [json.loads(x) for x in (tmp_path / "a" / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert all(0.0 <= e["pos1"] <= 1.0 for e in evals)
    # the trained drafter moved: the loss fell over six steps at lr 3e-3
    assert a[-1]["loss"] < a[0]["loss"]


def test_draft_space_loss_gradient_equals_autograd_of_the_plain_formula():
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(4, 3, 10, generator=g)).requires_grad_()
    full = torch.softmax(2 * torch.randn(4, 3, 14, generator=g), -1)    # 4 tokens outside
    greedy = torch.randint(-1, 10, (4, 3), generator=g)
    mask = torch.rand(4, 3, generator=g) > 0.2
    conf = torch.randn(4, 3, generator=g)
    terms, _ = draft_space_loss(logits, full[..., :10], greedy, mask, conf_logits=conf, decay=3.0)
    terms.total.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    p_d = torch.softmax(ref_logits, -1)
    l1 = (p_d - full[..., :10]).abs().sum(-1) + full[..., 10:].sum(-1)
    nll = -torch.log_softmax(ref_logits, -1).gather(-1, greedy.clamp_min(0)[..., None])[..., 0]
    w = torch.exp(-torch.arange(3.0) / 3.0) * mask
    w_ce = w * (greedy >= 0)
    c_star = (1 - 0.5 * l1).detach().clamp(0, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    ref = 0.1 * (nll * w_ce).sum() / w_ce.sum() + 0.9 * (l1 * w).sum() / w.sum() + \
        (bce * w).sum() / w.sum()
    ref.backward()
    assert float(terms.total.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=1e-4)


def _anchor_context_twin(drafter: DSparkDrafter, target) -> DSparkDrafter:
    """The same weights with ``anchor_context`` on."""
    cfg = DSparkConfig(**{**drafter.config.__dict__, "anchor_context": True})
    twin = DSparkDrafter(cfg, target.embed_tokens, drafter.shared_modules[1])
    twin.load_state_dict(drafter.state_dict())
    return twin


def test_anchor_context_adds_the_previous_context_state_to_the_anchor_slot(target, make_drafter):
    plain_drafter = _perturbed(make_drafter, target)
    drafter = _anchor_context_twin(plain_drafter, target)
    ids = torch.randint(2, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    mask = torch.arange(20) >= 3
    taps, _ = _tap_features(target, ids)
    anchors = torch.tensor([3, 8, 15])
    embed = target.embed_tokens
    h_ctx = drafter.backbone.hidden_norm(drafter.backbone.fc(taps[:15]))
    with_ctx, conf, _ = shared_context_forward(drafter, taps, ids, anchors)
    plain, _, _ = shared_context_forward(plain_drafter, taps, ids, anchors)
    assert not torch.allclose(with_ctx, plain, atol=1e-3)
    # the packed per-block forward (on-the-fly trainer) and the serving path agree
    lay = block_layout([ids], [mask], [anchors], block_size=4, label_offset=0, mask_token_id=1)
    packed, packed_conf = drafter_forward(drafter, taps[None], lay)
    torch.testing.assert_close(packed, with_ctx, atol=2e-5, rtol=1e-5)
    cache = drafter.new_cache(2, 32)
    drafter.extend_context(cache, torch.ones(15, dtype=torch.int64), torch.arange(15), taps[:15])
    for r, p in enumerate(anchors.tolist()):
        served, served_conf = drafter.teacher_forced(
            cache, torch.tensor([1]), ids[p:p + 1], torch.tensor([p]), lay.labels[r:r + 1])
        torch.testing.assert_close(served[0], with_ctx[r], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(served_conf[0], conf[r], atol=2e-5, rtol=1e-5)
    # reference: an embedding that adds H_ctx[p - 1] to slot 0 of each block (blocks in order)
    plain_drafter._shared = (lambda t: embed(t) + torch.where(
        (torch.arange(t.shape[1]) == 0)[None, :, None], h_ctx[anchors - 1][:, None], 0.0),
        plain_drafter.shared_modules[1])
    ref, _, _ = shared_context_forward(plain_drafter, taps, ids, anchors)
    torch.testing.assert_close(with_ctx, ref, atol=1e-5, rtol=1e-5)


def test_on_the_fly_trainer_refuses_a_pruned_drafter(tmp_path, target, make_drafter,
                                                     write_sequences):
    from dspark_serve.training.trainer import TrainConfig, train

    write_sequences(tmp_path / "data", n=2)
    pruned = _pruned_twin(make_drafter(target, "dspark"), target, KEEP)
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), steps=1,
                      dtype="float32")
    with pytest.raises(ValueError, match="train-cached"):
        train(cfg, progress=False, models=(target, pruned))


def _short_run(tmp_path, cache, init, out, **kw):
    return CacheTrainConfig(cache=[str(cache.folder)], out=str(tmp_path / out), init_from=init,
                            steps=3, seqs_per_step=2, anchors_per_seq=8, lr=3e-3, save_every=3,
                            log_every=1, eval_every=3, eval_seqs=2, **kw)


def test_sequences_held_in_memory_train_exactly_as_the_cache_they_came_from(
        tmp_path, target, make_drafter, write_sequences):
    cache = _cache(tmp_path, write_sequences)
    init = _init_folder(tmp_path, target, make_drafter)
    train_cached(_short_run(tmp_path, cache, init, "disk", eval_cache=str(cache.folder)),
                 target=target, log_fn=lambda m: None)
    held = [cache[i] for i in range(len(cache))]      # what a GPU run keeps in device memory
    train_cached(_short_run(tmp_path, cache, init, "memory"), target=target, caches=[held],
                 eval_sequences=held, log_fn=lambda m: None)
    disk, memory = _log(tmp_path / "disk"), _log(tmp_path / "memory")
    assert [r["loss"] for r in disk] == [r["loss"] for r in memory]
    evals = [(tmp_path / d / "eval_log.jsonl").read_text().splitlines() for d in ("disk", "memory")]
    assert [json.loads(x)["pos1"] for x in evals[0]] == [json.loads(x)["pos1"] for x in evals[1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_training_on_cuda_follows_the_cpu_run(tmp_path, make_drafter, write_sequences):
    target = make_target()
    cache = _cache(tmp_path, write_sequences)
    init = _init_folder(tmp_path, target, make_drafter)
    train_cached(_short_run(tmp_path, cache, init, "cpu"), target=target, log_fn=lambda m: None)
    gpu_target = make_target(device="cuda")
    train_cached(_short_run(tmp_path, cache, init, "cuda", device="cuda"), target=gpu_target,
                 log_fn=lambda m: None)
    cpu, gpu = _log(tmp_path / "cpu"), _log(tmp_path / "cuda")
    # bf16 autocast on the GPU: the same steps within bf16 rounding
    assert [r["blocks"] for r in cpu] == [r["blocks"] for r in gpu]
    for rc, rg in zip(cpu, gpu):
        assert rg["loss"] == pytest.approx(rc["loss"], rel=2e-2)
    final = load_drafter(tmp_path / "cuda" / "final", target.embed_tokens, target.lm_head)
    assert final.config.draft_vocab_size == 12 and torch.equal(final.draft_vocab, KEEP)
