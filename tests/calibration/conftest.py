"""Synthetic STS data with known truth: the head's logit is HEAD_SCALE times the true logit of
conditional survival, so T_k = HEAD_SCALE recovers the true survival probabilities exactly."""
import pytest
import torch

HEAD_SCALE = 2.5  # overconfident head: logits 2.5x too large


def make_rounds(n: int, gamma: int, seed: int):
    """Returns (conf_logits [n, gamma] f64, true_c [n, gamma] f64, survived [n, gamma] bool)."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 1.5 + 1.0
    true_c = torch.sigmoid(true_logit)
    accepted = torch.rand(n, gamma, generator=g, dtype=torch.float64) < true_c
    return HEAD_SCALE * true_logit, true_c, torch.cumprod(accepted, dim=1).bool()


@pytest.fixture(name="make_rounds")
def make_rounds_fixture():
    return make_rounds


@pytest.fixture
def head_scale():
    return HEAD_SCALE


@pytest.fixture(scope="module")
def overconfident_rounds():
    return make_rounds(20000, 5, seed=0)
