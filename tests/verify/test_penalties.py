import torch

from dspark_serve.verify.penalties import PenaltyState, apply_penalties, block_history_counts


def _reference(logits, prompt, output, rep, freq, pres, bias):
    """One position, one token at a time, the vLLM/OpenAI way."""
    out = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.numel()).float() \
        if output else torch.zeros_like(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    out -= freq * counts
    out -= pres * (counts > 0).float()
    return out + bias


def test_block_history_counts_matches_prefixes():
    drafts = torch.tensor([[3, 1, 3], [2, 2, 0], [4, 4, 4]])
    lengths = torch.tensor([3, 0, 2])
    got = block_history_counts(drafts, lengths, 5)
    rows = []
    for r in range(3):
        for j in range(int(lengths[r]) + 1):
            rows.append(torch.bincount(drafts[r, :j], minlength=5).float())
    assert torch.equal(got, torch.stack(rows))


def test_penalties_at_every_block_position_equal_one_token_at_a_time():
    g = torch.Generator().manual_seed(0)
    V, R, gamma = 11, 3, 4
    prompts = [[1, 2], [5], [0, 0, 7]]
    outputs = [[3, 3, 9], [], [7, 10]]
    drafts = torch.randint(0, V, (R, gamma), generator=g)
    lengths = torch.tensor([4, 0, 2])
    rep = torch.tensor([1.3, 1.0, 0.7])
    freq = torch.tensor([0.5, -0.2, 0.0])
    pres = torch.tensor([0.1, 0.4, -1.0])
    bias = torch.zeros(R, V)
    bias[0, 4] = 5.0
    bias[2, 1] = -100.0
    counts = torch.zeros(R, V)
    prompt_mask = torch.zeros(R, V, dtype=torch.bool)
    for r in range(R):
        for t in outputs[r]:
            counts[r, t] += 1
        prompt_mask[r, prompts[r]] = True
    state = PenaltyState(counts, prompt_mask, freq, pres, rep, bias)
    n = int((lengths + 1).sum())
    logits = torch.randn(n, V, generator=g) * 3
    row_request = torch.repeat_interleave(torch.arange(R), lengths + 1)
    got = apply_penalties(logits, row_request, state, block_history_counts(drafts, lengths, V))
    i = 0
    for r in range(R):
        for j in range(int(lengths[r]) + 1):
            history = outputs[r] + drafts[r, :j].tolist()
            want = _reference(logits[i], prompts[r], history, float(rep[r]), float(freq[r]),
                              float(pres[r]), bias[r])
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)
            i += 1


def test_no_penalty_is_identity_and_does_not_modify_input():
    logits = torch.randn(4, 6)
    before = logits.clone()
    state = PenaltyState(torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.bool), torch.zeros(2),
                         torch.zeros(2), torch.ones(2))
    out = apply_penalties(logits, torch.tensor([0, 0, 1, 1]), state)
    assert torch.equal(out, before) and torch.equal(logits, before)
