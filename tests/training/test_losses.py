"""Eq 8-12 on a fixed batch against values computed by hand (plain Python floats)."""
import math

import pytest
import torch

from dspark_serve.training.losses import acceptance_label, drafter_loss, position_weights

DRAFT = [[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]], [[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]]
TARGET = [[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], [[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]]
LABELS = [[0, 1], [1, 2]]
MASK = [[True, True], [True, False]]
CONF = [[0.3, -0.2], [1.0, 0.5]]
DECAY = 2.0


def softmax(xs, t=1.0):
    e = [math.exp(x / t) for x in xs]
    return [v / sum(e) for v in e]


def reference(alpha_ce, alpha_tv, alpha_conf, temperature):
    """Eq 9-12 term by term: weighted means over supervised (block, position) pairs."""
    num = {"ce": 0.0, "tv": 0.0, "conf": 0.0}
    den = 0.0
    for r in range(2):
        for k in range(2):
            if not MASK[r][k]:
                continue
            w = math.exp(-k / DECAY)
            p_raw = softmax(DRAFT[r][k])
            p_d = softmax(DRAFT[r][k], temperature)
            p_t = softmax(TARGET[r][k], temperature)
            l1 = sum(abs(a - b) for a, b in zip(p_d, p_t))
            c_star = 1 - 0.5 * l1
            c = 1 / (1 + math.exp(-CONF[r][k]))
            num["ce"] += w * -math.log(p_raw[LABELS[r][k]])
            num["tv"] += w * l1
            num["conf"] += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            den += w
    terms = {k: v / den for k, v in num.items()}
    terms["total"] = alpha_ce * terms["ce"] + alpha_tv * terms["tv"] + alpha_conf * terms["conf"]
    return terms


def tensors():
    return (torch.tensor(DRAFT, requires_grad=True), torch.tensor(TARGET),
            torch.tensor(LABELS), torch.tensor(MASK), torch.tensor(CONF, requires_grad=True))


def test_position_weights():
    assert torch.allclose(position_weights(3, 4.0),
                          torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    with pytest.raises(ValueError):
        position_weights(3, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("alphas", [(0.1, 0.9, 1.0), (0.5, 0.0, 2.0)])
def test_loss_terms_equal_hand_computed_values(alphas, temperature):
    draft, target, labels, mask, conf = tensors()
    got = drafter_loss(draft, labels, mask, target_logits=target, conf_logits=conf,
                       alpha_ce=alphas[0], alpha_tv=alphas[1], alpha_conf=alphas[2],
                       decay=DECAY, temperature=temperature)
    ref = reference(*alphas, temperature)
    for name in ("total", "ce", "tv", "conf"):
        assert float(getattr(got, name).detach()) == pytest.approx(ref[name], rel=1e-5), name


def test_acceptance_label_is_eq8_and_detached():
    p = torch.tensor([[0.5, 0.5, 0.0]], requires_grad=True)
    q = torch.tensor([[0.2, 0.3, 0.5]])
    label = acceptance_label(p, q)
    assert float(label) == pytest.approx(1 - 0.5 * (0.3 + 0.2 + 0.5))
    assert not label.requires_grad
    # L_conf alone sends no gradient into the draft distribution (the label is detached)
    draft, target, labels, mask, conf = tensors()
    loss = drafter_loss(draft, labels, mask, target_logits=target, conf_logits=conf,
                        alpha_ce=0.0, alpha_tv=0.0, alpha_conf=1.0, decay=DECAY)
    loss.total.backward()
    assert draft.grad is None or float(draft.grad.abs().sum()) == 0.0
    assert float(conf.grad.abs().sum()) > 0


def test_diagnostics_expected_tau_and_acceptance():
    draft, target, labels, mask, conf = tensors()
    got = drafter_loss(draft, labels, mask, target_logits=target, conf_logits=conf, decay=DECAY)
    c = [[1 - 0.5 * sum(abs(a - b) for a, b in zip(softmax(DRAFT[r][k]), softmax(TARGET[r][k])))
          for k in range(2)] for r in range(2)]
    assert got.accept.tolist() == pytest.approx([(c[0][0] + c[1][0]) / 2, c[0][1]], rel=1e-5)
    tau = ((1 + c[0][0] + c[0][0] * c[0][1]) + (1 + c[1][0])) / 2
    assert got.expected_tau == pytest.approx(tau, rel=1e-5)


def test_dflash_ce_only_needs_no_target():
    draft, _, labels, mask, _ = tensors()
    got = drafter_loss(draft, labels, mask, alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0, decay=DECAY)
    assert float(got.total.detach()) == pytest.approx(reference(1.0, 0.0, 0.0, 1.0)["ce"], rel=1e-6)
    assert float(got.tv) == 0.0 and float(got.conf) == 0.0
    with pytest.raises(ValueError, match="target_logits"):
        drafter_loss(draft, labels, mask, decay=DECAY)  # default alpha_tv 0.9
    with pytest.raises(ValueError, match="labels"):
        drafter_loss(draft, labels[:1], mask, alpha_tv=0.0, decay=DECAY)
