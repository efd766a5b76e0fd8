"""rejection_sample against a per-row Python loop, table-driven greedy cases, input checks."""
import pytest
import torch

from dspark_serve.verify.rejection import PAD_TOKEN, rejection_sample


def reference_verify(target, drafts, draft_probs, length, u_accept, u_final):
    """One request written out as Leviathan et al. Algorithm 1 (lists of floats)."""
    out = []
    for k in range(length):
        x = drafts[k]
        p_t, p_d = target[k][x], draft_probs[k][x]
        if p_d > 0 and u_accept[k] < p_t / p_d or p_d == 0 and p_t > 0:
            out.append(x)
            continue
        residual = [max(0.0, a - b) for a, b in zip(target[k], draft_probs[k])]
        weights = residual if sum(residual) > 0 else target[k]
        return len(out), out + [_inverse_cdf(weights, u_final)]
    return len(out), out + [_inverse_cdf(target[length], u_final)]


def _inverse_cdf(weights, u):
    """First token with mass whose cumulative float32 weight exceeds u * total."""
    cdf = torch.tensor(weights, dtype=torch.float32).cumsum(0)
    target, last = u * cdf[-1].item(), max(i for i, w in enumerate(weights) if w > 0)
    return min(next((i for i, c in enumerate(cdf.tolist()) if c > target), last), last)


def _check_against_reference(target, drafts, draft_probs, lengths, u_accept, u_final):
    got = rejection_sample(target, drafts, draft_probs, lengths, u_accept, u_final)
    gamma = drafts.shape[1]
    for r in range(drafts.shape[0]):
        n, toks = reference_verify(target[r].tolist(), drafts[r].tolist(), draft_probs[r].tolist(),
                                   int(lengths[r]), u_accept[r].tolist(), float(u_final[r]))
        assert got.num_accepted[r].item() == n, f"row {r}"
        assert got.num_tokens[r].item() == n + 1
        assert got.tokens[r].tolist() == toks + [PAD_TOKEN] * (gamma - n), f"row {r}"


def _random_block(gen, num_req, gamma, vocab, sharpness=2.0):
    target = torch.softmax(torch.randn(num_req, gamma + 1, vocab, generator=gen) * sharpness, -1)
    draft = torch.softmax(torch.randn(num_req, gamma, vocab, generator=gen) * sharpness, -1)
    drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(num_req, gamma)
    lengths = torch.randint(0, gamma + 1, (num_req,), generator=gen)
    return target, drafts, draft, lengths


@pytest.mark.parametrize("gamma, vocab", [(1, 2), (3, 5), (5, 17), (8, 3)])
def test_matches_reference_random(gamma, vocab):
    gen = torch.Generator().manual_seed(gamma * 100 + vocab)
    target, drafts, draft, lengths = _random_block(gen, 300, gamma, vocab)
    # Edge rows: identical distributions, drafts the target gives zero mass, one-hot targets.
    draft[:20] = target[:20, :gamma]
    target[20:40, :gamma].scatter_(2, drafts[20:40, :, None], 0.0)
    target[40:60] = torch.nn.functional.one_hot(target[40:60].argmax(-1), vocab).float()
    lengths[:10] = gamma
    lengths[60:70] = 0
    u_accept, u_final = torch.rand(300, gamma, generator=gen), torch.rand(300, generator=gen)
    _check_against_reference(target, drafts, draft, lengths, u_accept, u_final)


def _one_hot(ids, vocab=6):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


# (target argmax at positions 0..gamma, draft tokens, l_r) -> emitted tokens; gamma = 4.
GREEDY_CASES = {
    "perfect match": ([1, 2, 3, 4, 5], [1, 2, 3, 4], 4, [1, 2, 3, 4, 5]),
    "mismatch at first": ([1, 2, 3, 4, 5], [0, 2, 3, 4], 4, [1]),
    "mismatch at third": ([1, 2, 3, 4, 5], [1, 2, 0, 4], 4, [1, 2, 3]),
    "empty draft": ([3, 2, 3, 4, 5], [3, 2, 3, 4], 0, [3]),
    "short prefix all matching": ([1, 2, 3, 4, 5], [1, 2, 3, 4], 2, [1, 2, 3]),
    "mismatch after the prefix": ([1, 2, 3, 4, 5], [1, 0, 0, 0], 1, [1, 2]),
    "mismatch inside the prefix": ([1, 2, 3, 4, 5], [1, 0, 3, 4], 3, [1, 2]),
}


@pytest.mark.parametrize("one_hot_drafts", [True, False], ids=["greedy-draft", "sampled-draft"])
def test_greedy_cases_in_one_mixed_batch(one_hot_drafts):
    cases = list(GREEDY_CASES.values())
    target = torch.stack([_one_hot(argmax) for argmax, *_ in cases])
    drafts = torch.tensor([d for _, d, _, _ in cases])
    if one_hot_drafts:
        draft_probs = _one_hot(drafts.tolist())
    else:  # a soft drafter that sampled these tokens: greedy verification must not care
        draft_probs = torch.full((len(cases), 4, 6), 0.1).scatter_(2, drafts[..., None], 0.5)
    lengths = torch.tensor([l for *_, l, _ in cases])
    gen = torch.Generator().manual_seed(0)
    got = rejection_sample(target, drafts, draft_probs, lengths,
                           torch.rand(len(cases), 4, generator=gen), torch.rand(len(cases), generator=gen))
    for r, (name, (*_, want)) in enumerate(GREEDY_CASES.items()):
        assert got.tokens[r].tolist() == want + [PAD_TOKEN] * (5 - len(want)), name
        assert got.num_accepted[r].item() == len(want) - 1, name
    assert torch.equal(got.num_tokens, got.num_accepted + 1)


def test_entries_beyond_the_prefix_are_ignored():
    gen = torch.Generator().manual_seed(3)
    target, drafts, draft, lengths = _random_block(gen, 64, 5, 7)
    u_accept, u_final = torch.rand(64, 5, generator=gen), torch.rand(64, generator=gen)
    clean = rejection_sample(target, drafts, draft, lengths, u_accept, u_final)
    beyond_target = torch.arange(6)[None, :] > lengths[:, None]
    beyond_draft = torch.arange(5)[None, :] >= lengths[:, None]
    target[beyond_target] = float("nan")
    draft[beyond_draft] = float("nan")
    drafts[beyond_draft] = -1
    dirty = rejection_sample(target, drafts, draft, lengths, u_accept, u_final)
    assert torch.equal(clean.tokens, dirty.tokens)
    assert torch.equal(clean.num_accepted, dirty.num_accepted)


def test_zero_length_block_samples_the_target():
    target = torch.tensor([[[0.2, 0.0, 0.8]], [[0.0, 1.0, 0.0]]])
    got = rejection_sample(target, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, 3),
                           torch.zeros(2, dtype=torch.int64), torch.zeros(2, 0),
                           torch.tensor([0.5, 0.9]))
    assert got.tokens.tolist() == [[2], [1]]
    assert got.num_accepted.tolist() == [0, 0]


def _valid_inputs():
    gen = torch.Generator().manual_seed(4)
    target, drafts, draft, lengths = _random_block(gen, 3, 2, 4)
    return dict(target_probs=target, draft_tokens=drafts, draft_probs=draft, lengths=lengths,
                u_accept=torch.rand(3, 2, generator=gen), u_final=torch.rand(3, generator=gen))


@pytest.mark.parametrize("name, bad, match", [
    ("target_probs", torch.rand(3, 2, 4), "target_probs"),
    ("target_probs", torch.rand(3, 3, 4, dtype=torch.float64), "target_probs"),
    ("draft_probs", torch.rand(3, 2, 5), "draft_probs"),
    ("draft_tokens", torch.zeros(3, 2, dtype=torch.int32), "draft_tokens"),
    ("draft_tokens", torch.zeros(3), "draft_tokens"),
    ("lengths", torch.zeros(4, dtype=torch.int64), "lengths"),
    ("lengths", torch.tensor([0, 3, 1]), "lengths must be in 0..2"),
    ("lengths", torch.tensor([0, -1, 1]), "lengths must be in 0..2"),
    ("u_accept", torch.rand(3, 3), "u_accept"),
    ("u_final", torch.rand(3, dtype=torch.float64), "u_final"),
    ("draft_tokens", torch.tensor([[0, 4], [1, 1], [2, 2]]), "verified draft tokens"),
])
def test_rejects_bad_inputs(name, bad, match):
    inputs = _valid_inputs()
    inputs["lengths"] = torch.tensor([2, 2, 2])
    inputs[name] = bad
    with pytest.raises(ValueError, match=match):
        rejection_sample(**inputs)
