"""Paper Appendix A: a retrospective global search (no early stop) on the current step's own
survival leaks x_1 into its admission and biases the output; Algorithm 1's early stop and the
asynchronous scheduler's lagged capacity recover the target distribution.

R = 1, gamma = 2, vocabulary {A, B}, p_t = (0.7, 0.3), p_d = (0.5, 0.5), SPS(1, 2, 3) =
(1.0, 0.5, 0.45), c_1 = 0.8 and c_2 = 0.9 if x_1 = A else 0. Retrospective: x_1 = A gives
Theta = (1.0, 0.9, 1.134) -> l = 2, x_1 = B gives (1.0, 0.9, 0.81) -> l = 0, so
P(Y = A) = 0.5 * 1 + 0.5 * 0.7 = 0.85 instead of 0.7.
"""
import pytest
import torch

from dspark_serve.scheduling import CostTable, make_scheduler
from dspark_serve.scheduling import admission
from dspark_serve.verify import rejection_sample

TABLE = CostTable((1, 2, 3), (1.0, 0.5, 0.45), 3)
P_TARGET = torch.tensor([0.7, 0.3])
P_DRAFT = torch.tensor([0.5, 0.5])
TOKEN_A = 0
TRIALS = 20_000     # binomial sd of P(Y = A) ~ 0.0032, so 0.01 is ~3 sd
TOLERANCE = 0.01


def retrospective(confidence: torch.Tensor) -> torch.Tensor:
    """Global argmax of Theta over the CURRENT step's ranking: the anticipating scheduler."""
    ranking = admission.rank_slots(admission.survival(confidence))
    theta = admission.throughput_curve(ranking.cum, confidence.shape[0], ranking.positive, TABLE)
    return admission.admit_first(ranking.rows, int(theta.argmax()), confidence.shape[0])


def first_token_distribution(scheduler, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    drafts = (torch.rand(TRIALS, 2, generator=gen) >= P_DRAFT[TOKEN_A]).long()   # x ~ p_d
    c2 = torch.where(drafts[:, 0] == TOKEN_A, 0.9, 0.0)
    confidence = torch.stack([torch.full((TRIALS,), 0.8), c2], dim=1)
    # One scheduler call per trial (R = 1), in order, so the async history evolves.
    lengths = torch.cat([scheduler(confidence[i:i + 1]) for i in range(TRIALS)])
    result = rejection_sample(P_TARGET.expand(TRIALS, 3, 2).contiguous(), drafts,
                              P_DRAFT.expand(TRIALS, 2, 2).contiguous(), lengths,
                              torch.rand(TRIALS, 2, generator=gen),
                              torch.rand(TRIALS, generator=gen))
    p_a = (result.tokens[:, 0] == TOKEN_A).double().mean()
    return torch.stack([p_a, 1 - p_a])


@pytest.mark.lossless
def test_retrospective_search_is_biased():
    dist = first_token_distribution(retrospective, seed=0)
    assert dist.tolist() == pytest.approx([0.85, 0.15], abs=TOLERANCE)


@pytest.mark.lossless
@pytest.mark.parametrize("name", ["algorithm1", "async"])
def test_early_stop_and_lagged_capacity_are_lossless(name):
    scheduler = make_scheduler(name, gamma=2, cost_table=TABLE)
    dist = first_token_distribution(scheduler, seed=1)
    assert dist.tolist() == pytest.approx([0.7, 0.3], abs=TOLERANCE)


@pytest.mark.lossless
def test_async_with_known_lookup_rows_is_lossless():
    """R = 2: row 0 a prompt-lookup row (one-hot draft A A, survival fixed before drafting,
    varying over trials), row 1 the anticipating drafter row above. K sees row 0's survival
    of the step itself and row 1's of two steps back: both rows keep the target distribution,
    and row 0 is verified in the very steps its survival is high."""
    # with no lookup match, Theta over row 1 alone has Appendix A's shape (dip at B = 3)
    table = CostTable((1, 2, 3, 4, 5, 6), (1.0, 1.0, 0.6, 0.65, 0.6, 0.55), 6)
    scheduler = make_scheduler("async", gamma=2, cost_table=table)
    gen = torch.Generator().manual_seed(3)
    drafts = (torch.rand(TRIALS, 2, generator=gen) >= P_DRAFT[TOKEN_A]).long()
    c2 = torch.where(drafts[:, 0] == TOKEN_A, 0.9, 0.0)
    high = torch.arange(TRIALS) % 3 == 0
    lookup_c = torch.where(high, 0.9, 0.0)
    known = torch.tensor([True, False])
    lengths = torch.stack([scheduler(torch.tensor([[lookup_c[i], lookup_c[i]], [0.8, c2[i]]]),
                                     known) for i in range(TRIALS)])
    assert (lengths[2:, 0][high[2:]] == 2).all()
    lookup_drafts = torch.full((TRIALS, 2), TOKEN_A)
    one_hot = torch.nn.functional.one_hot(lookup_drafts, 2).float()
    for drafted, probs, row in ((lookup_drafts, one_hot, 0),
                                (drafts, P_DRAFT.expand(TRIALS, 2, 2).contiguous(), 1)):
        result = rejection_sample(P_TARGET.expand(TRIALS, 3, 2).contiguous(), drafted, probs,
                                  lengths[:, row], torch.rand(TRIALS, 2, generator=gen),
                                  torch.rand(TRIALS, generator=gen))
        p_a = float((result.tokens[:, 0] == TOKEN_A).double().mean())
        assert p_a == pytest.approx(0.7, abs=TOLERANCE), row
