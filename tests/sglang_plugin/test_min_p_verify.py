"""min-p in DSPARK_SERVE's verify: the logits SGLang's accept receives from our executor."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="sglang not installed (pip install 'dspark-serve[sglang]')")

from sglang.srt.speculative.dspark_components.dspark_verify import (  # noqa: E402
    TargetVerifyExecutor)
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import (  # noqa: E402
    DSparkWorkerV2)

from dspark_serve.sglang_plugin.verify_fixes import min_p_target_logits  # noqa: E402
from dspark_serve.sglang_plugin.worker import (DSparkServeVerifyExecutor,  # noqa: E402
                                               DSparkServeWorker)
from dspark_serve.verify.rejection import rejection_sample  # noqa: E402

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _sampling(min_ps, need=True):
    return SimpleNamespace(need_min_p_sampling=need, temperatures=torch.ones(len(min_ps), 1),
                           min_ps=torch.tensor(min_ps))


@pytest.fixture
def handed_to_sglang(monkeypatch):
    """Call our executor; return the target logits SGLang's accept_and_finalize receives."""
    seen = {}

    def sglang_accept(self, *, target_logits, **kwargs):
        seen["logits"] = target_logits
        return "accept"

    monkeypatch.setattr(TargetVerifyExecutor, "accept_and_finalize", sglang_accept)
    executor = object.__new__(DSparkServeVerifyExecutor)
    executor.verify_num_draft_tokens = 2          # gamma = 1: rows per request

    def run(logits, sampling_info, folded=False):
        out = executor.accept_and_finalize(folded_accept=folded, bs=2, verify_ids_2d=None,
                                           target_logits=logits, draft_block=None,
                                           sampling_info=sampling_info)
        assert out == "accept"
        return seen["logits"]
    return run


def test_min_p_forbidden_draft_gets_zero_target_probability_and_is_rejected(handed_to_sglang):
    # Request 0: min_p 0.4 keeps p >= 0.4 * 0.5 = 0.2 -> tokens 0, 1; request 1: min-p off.
    logits = PROBS.log().repeat(4, 1)                          # [R * (gamma+1), V], R = 2
    out = handed_to_sglang(logits, _sampling([0.4, 0.0]))
    # SGLang's accept takes softmax(logits / T), T = 1.
    target = torch.softmax(out, dim=-1).view(2, 2, 4)
    assert torch.allclose(target[0], torch.tensor([0.625, 0.375, 0.0, 0.0]).repeat(2, 1))
    assert torch.allclose(target[1], PROBS.repeat(2, 1))
    # Verify draft token 2 in both requests with p_d = 1 and the smallest uniform (accepts
    # any token of positive target probability): request 0 rejects (p_t = 0) and recovers
    # from the residual [.625, .375, 0, 0] at u = .7 -> token 1; request 1 accepts (.15 > 0)
    # and draws the bonus from [.5, .3, .15, .05] at u = .7 -> token 1.
    result = rejection_sample(target, torch.tensor([[2], [2]]),
                              torch.nn.functional.one_hot(torch.tensor([[2], [2]]), 4).float(),
                              torch.tensor([1, 1]), torch.zeros(2, 1), torch.tensor([0.7, 0.7]))
    assert result.num_accepted.tolist() == [0, 1]
    assert result.tokens.tolist() == [[1, -1], [2, 1]]


def test_min_p_off_or_folded_passes_logits_through(handed_to_sglang):
    logits = PROBS.log().repeat(4, 1)
    assert handed_to_sglang(logits, _sampling([0.4, 0.0], need=False)) is logits
    assert handed_to_sglang(logits, _sampling([0.4, 0.0]), folded=True) is logits
    assert handed_to_sglang(logits, None) is logits


def test_min_p_target_logits_rows_and_errors():
    logits = PROBS.log().repeat(6, 1)
    out = min_p_target_logits(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.4]), 3)
    assert torch.equal(out[:3], logits[:3])
    assert torch.isinf(out[3:, 2:]).all() and torch.equal(out[3:, :2], logits[3:, :2])
    with pytest.raises(ValueError, match="R = 2"):
        min_p_target_logits(logits, torch.ones(2), torch.zeros(2), 2)


def test_min_p_batches_stay_off_the_sampling_accept_graph():
    worker = object.__new__(DSparkServeWorker)
    worker._sampling_accept_graph = object()
    worker._verify_planner = SimpleNamespace(mode_value="static")
    info = SimpleNamespace(is_any_greedy=False, need_top_k_sampling=False,
                           need_top_p_sampling=False, has_custom_logit_processor=False,
                           need_min_p_sampling=False)
    kwargs = dict(batch=SimpleNamespace(has_grammar=False), proposal_folded=True,
                  simulate_bonus_sampling_info=None)
    assert DSparkWorkerV2._sampling_graph_eligible(worker, sampling_info=info, **kwargs)
    assert worker._sampling_graph_eligible(sampling_info=info, **kwargs) is True
    info.need_min_p_sampling = True
    assert worker._sampling_graph_eligible(sampling_info=info, **kwargs) is False
