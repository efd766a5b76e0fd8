"""The shared ranking: descending survival, ties by position then request, consistent sums
and counts, host (NumPy) and device (torch) rankers identical."""
import torch

from dspark_serve.scheduling import admission


def random_survival(gen: torch.Generator, num_req: int, gamma: int) -> torch.Tensor:
    conf = torch.rand(num_req, gamma, generator=gen)
    conf[conf > 0.7] = 1.0                                # exact ties
    conf[conf < 0.05] = 0.0
    return admission.survival(conf)


def test_ranking_is_descending_prefix_respecting_and_the_same_on_both_paths():
    gen = torch.Generator().manual_seed(5)
    for case in range(40):
        num_req, gamma = int(torch.randint(1, 30, (1,), generator=gen)), 5
        surv = random_survival(gen, num_req, gamma)
        lengths = torch.randint(0, gamma + 1, (num_req,), generator=gen)
        eligible = torch.arange(gamma)[None, :] < lengths[:, None]
        for mask in (None, eligible):
            ranking = admission.rank_slots(surv, mask)
            flat_mask = None if mask is None else mask.t().reshape(-1)
            on_device = admission._rank_on_device(surv.t().reshape(-1), flat_mask, num_req)
            for got, expected in zip(ranking, on_device):
                assert (torch.equal(got, expected) if isinstance(got, torch.Tensor)
                        else got == expected), case
            keyed = surv if mask is None else surv.masked_fill(~mask, -1.0)
            values = ranking.values
            assert torch.equal(values, keyed.reshape(-1).double().sort(descending=True).values)
            assert torch.allclose(ranking.cum[1:], values.clamp(min=0).cumsum(0), rtol=0,
                                  atol=1e-12) and ranking.cum[0] == 0
            assert ranking.positive == int((keyed > 0).sum()), case
            assert ranking.eligible == int((keyed >= 0).sum()), case
            # Every cut is a set of prefixes: row r's i-th ranked slot is its position i.
            seen = torch.zeros(num_req, dtype=torch.int64)
            for value, row in zip(values.tolist(), ranking.rows.tolist()):
                assert value == float(keyed[row, seen[row]]), case
                seen[row] += 1


def test_negative_zero_confidence_ranks_as_zero():
    ranking = admission.rank_slots(admission.survival(torch.tensor([[0.5, -0.0], [0.0, 1.0]])))
    assert ranking.values.tolist() == [0.5, 0.0, 0.0, 0.0]
    assert ranking.rows.tolist() == [0, 1, 0, 1]
    assert (ranking.positive, ranking.eligible) == (1, 4)
