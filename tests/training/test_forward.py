"""The packed training forward equals the serving path block by block, and trains the context."""
import pytest
import torch

from dspark_serve.training.anchors import block_layout
from dspark_serve.training.forward import drafter_forward
from dspark_serve.training.target_features import target_features


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_training_forward_matches_inference_teacher_forcing(target, make_drafter, kind):
    drafter = make_drafter(target, kind, seed=1)
    with torch.no_grad():  # move every parameter off its init so each part matters
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 64, (n,), generator=g) for n in (14, 9)]
    masks = [torch.arange(n) >= 4 for n in (14, 9)]
    anchors = [torch.tensor([4, 8, 12]), torch.tensor([5, 7])]
    lay = block_layout(seqs, masks, anchors, block_size=4, label_offset=0, mask_token_id=1)
    feats = target_features(target, seqs, lay)
    logits, conf = drafter_forward(drafter, feats.taps, lay)
    assert logits.shape == (5, 4, 64) and conf.shape == (5, 4)
    # serving path: a context cache holding exactly the positions before each anchor
    for r in range(lay.num_blocks):
        s, p = int(lay.seq_index[r]), int(lay.anchor_positions[r])
        cache = drafter.new_cache(1, 32)
        drafter.extend_context(cache, torch.zeros(p, dtype=torch.int64), torch.arange(p),
                               feats.taps[s, :p])
        ref_logits, ref_conf = drafter.teacher_forced(
            cache, torch.tensor([0]), lay.input_ids[r:r + 1, 0], torch.tensor([p]),
            lay.labels[r:r + 1])
        torch.testing.assert_close(logits[r:r + 1].detach(), ref_logits.detach(),
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(conf[r:r + 1].detach(), ref_conf.detach(), atol=2e-5, rtol=1e-5)
    # target logits are the target's next-token logits at anchor + k - 1
    with torch.no_grad():
        cache = target.new_kv_cache(1, 16)
        slot = cache.allocate()
        full = target.forward(seqs[0], torch.full((14,), slot), torch.arange(14), cache).logits
    torch.testing.assert_close(feats.logits[0], full[4:8])
    # anchor 12 of a 14-token sequence: only label 13 exists; masked slots repeat position 12
    torch.testing.assert_close(feats.logits[2], full[[12, 12, 12, 12]])
    assert lay.label_mask[2].tolist() == [True, False, False, False]


def test_gradients_reach_context_projection_but_not_shared_modules(target, make_drafter):
    drafter = make_drafter(target, "dspark")
    seqs = [torch.randint(2, 64, (12,), generator=torch.Generator().manual_seed(1))]
    lay = block_layout(seqs, [torch.arange(12) >= 3], [torch.tensor([5, 8])], block_size=4,
                       label_offset=0, mask_token_id=1)
    feats = target_features(target, seqs, lay)
    logits, conf = drafter_forward(drafter, feats.taps, lay)
    (logits.logsumexp(-1).sum() + conf.sum()).backward()
    for name in ("backbone.fc.weight", "backbone.layers.0.self_attn.k_proj.weight",
                 "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert float(dict(drafter.named_parameters())[name].grad.abs().sum()) > 0, name
    assert not target.lm_head.weight.requires_grad
    assert target.lm_head.weight.grad is None and target.embed_tokens.weight.grad is None
