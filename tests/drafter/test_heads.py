"""Sequential heads (Eq 5, 6, gated variant) and the confidence head (Eq 7) against
hand-written references on tiny examples."""
import pytest
import torch

from dspark_serve.drafter.confidence_head import ConfidenceHead
from dspark_serve.drafter.markov_head import GatedMarkovHead, MarkovHead
from dspark_serve.drafter.model import build_sequential_head
from dspark_serve.drafter.rnn_head import RNNHead


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module.double()


def test_markov_bias_by_hand():
    head = MarkovHead(vocab_size=3, rank=1)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.tensor([[1.0], [2.0], [3.0]]))
        head.markov_w2.weight.copy_(torch.tensor([[1.0], [0.0], [-1.0]]))
    state, bias = head.step(None, torch.tensor([1, 2]), torch.zeros(2, 5))
    assert state is None
    assert bias.tolist() == [[2.0, 0.0, -2.0], [3.0, 0.0, -3.0]]


def test_markov_and_gated_match_reference():
    vocab, rank, hidden = 11, 3, 4
    prev = torch.tensor([[0, 5, 10], [7, 7, 1]])
    h = torch.randn(2, 3, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    vanilla = _randomize(MarkovHead(vocab, rank), 0)
    w1, w2 = vanilla.markov_w1.weight, vanilla.markov_w2.weight
    torch.testing.assert_close(vanilla.step(None, prev, h)[1], w1[prev] @ w2.T)
    gated = _randomize(GatedMarkovHead(vocab, rank, hidden), 2)
    w1, w2 = gated.markov_w1.weight, gated.markov_w2.weight
    gate = torch.sigmoid(torch.cat([h, w1[prev]], -1) @ gated.gate_proj.weight.T
                         + gated.gate_proj.bias)
    torch.testing.assert_close(gated.step(None, prev, h)[1], (gate * w1[prev]) @ w2.T)


def test_rnn_head_matches_hand_written_recurrence():
    vocab, rank, hidden, steps = 7, 3, 4, 4
    head = _randomize(RNNHead(vocab, rank, hidden), 3)
    assert head.joint_proj.weight.shape == (3 * rank, 2 * rank + hidden)
    prev = torch.tensor([[2, 6, 0, 3], [1, 1, 5, 4]])
    h = torch.randn(2, steps, hidden, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(4))
    state = head.init_state((2,), h)
    assert state.shape == (2, rank) and not state.any()
    biases, states = [], []
    for k in range(steps):
        state, bias = head.step(state, prev[:, k], h[:, k])
        biases.append(bias)
        states.append(state)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    jw, jb = head.joint_proj.weight, head.joint_proj.bias
    for row in range(2):
        s = torch.zeros(rank, dtype=torch.float64)
        for k in range(steps):
            pre = jw @ torch.cat([s, w1[prev[row, k]], h[row, k]]) + jb
            g, c, o = pre[:rank].sigmoid(), pre[rank:2 * rank].tanh(), pre[2 * rank:].tanh()
            s = g * s + (1 - g) * c
            torch.testing.assert_close(states[k][row], s)
            torch.testing.assert_close(biases[k][row], w2 @ o)
    with pytest.raises(ValueError, match="previous state"):
        head.step(None, prev[:, 0], h[:, 0])


def test_confidence_head_with_and_without_markov_feature():
    hidden, rank = 5, 3
    h = torch.randn(2, 4, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    emb = torch.randn(2, 4, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with_markov = _randomize(ConfidenceHead(hidden, rank), 7)
    assert with_markov.proj.weight.shape == (1, hidden + rank)
    out = with_markov(h, emb)
    assert out.shape == (2, 4) and out.dtype == torch.float32
    expected = torch.cat([h, emb], -1) @ with_markov.proj.weight[0] + with_markov.proj.bias[0]
    torch.testing.assert_close(out, expected.float())
    plain = _randomize(ConfidenceHead(hidden), 8)
    torch.testing.assert_close(plain(h, None),
                               (h @ plain.proj.weight[0] + plain.proj.bias[0]).float())
    with pytest.raises(ValueError, match="prev_embedding"):
        plain(h, emb)
    with pytest.raises(ValueError, match="prev_embedding"):
        with_markov(h, None)


def test_build_sequential_head_from_config(tiny_config):
    assert build_sequential_head(tiny_config(markov_rank=0, enable_confidence_head=False,
                                             confidence_head_with_markov=False)) is None
    for kind, cls in (("vanilla", MarkovHead), ("gated", GatedMarkovHead), ("rnn", RNNHead)):
        head = build_sequential_head(tiny_config(markov_head_type=kind))
        assert type(head) is cls and head.rank == 6
