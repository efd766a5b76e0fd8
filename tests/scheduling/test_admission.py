"""The shared ranking: descending survival, ties by position then request, host (NumPy) and
device (torch) rankers identical."""
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
            values, rows = admission.rank_slots(surv, mask)
            keyed = surv if mask is None else surv.masked_fill(~mask, -1.0)
            flat = keyed.t().reshape(-1)
            device_values, device_rows = admission._rank_on_device(flat, num_req)
            assert torch.equal(values, device_values) and torch.equal(rows, device_rows), case
            assert bool((values[:-1] >= values[1:]).all()), case
            assert torch.equal(values, flat.double().sort(descending=True).values), case
            # Every cut is a set of prefixes: row r's i-th ranked slot is its position i.
            seen = torch.zeros(num_req, dtype=torch.int64)
            for value, row in zip(values.tolist(), rows.tolist()):
                assert value == float(keyed[row, seen[row]]), case
                seen[row] += 1


def test_negative_zero_confidence_ranks_as_zero():
    surv = admission.survival(torch.tensor([[0.5, -0.0], [0.0, 1.0]]))
    values, rows = admission.rank_slots(surv)
    assert values.tolist() == [0.5, 0.0, 0.0, 0.0] and rows.tolist() == [0, 1, 0, 1]
    assert admission.num_admissible(values) == 1
    assert admission.num_admissible(values, admit_zero=True) == 4
