"""Statistical losslessness: multi-round speculative decoding with scheduled verification
lengths reproduces the target's joint distribution of the first output tokens.

Toy models over a vocabulary of ``VOCAB`` tokens whose next-token distributions depend on the
previous token (random transition tables), so each draft, its confidence and hence the
scheduled length depend on earlier drafted tokens, as with DSpark's Markov confidence head
(paper Eq 7). Every round: draft ``GAMMA`` tokens left to right, compute the conditional
confidence c_k from x_{k-1}, schedule l_r per batch of ``BATCH`` requests, verify, commit the
accepted drafts plus the recovered/bonus token. After ``OUT_TOKENS`` tokens per request the
empirical joint distribution must pass a chi-square test against the exact target joint; the
tests at the end show the same check rejects a wrong verifier and an anticipating scheduler.
"""
from typing import Callable

import pytest
import torch
from scipy import stats

from dspark_serve.sampling import sample_from_probs, warp_probs
from dspark_serve.scheduling import make_scheduler
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.types import SamplingTensors, VerifyResult
from dspark_serve.verify import rejection_sample

VOCAB = 6
GAMMA = 4
BATCH = 40              # requests per scheduler call
NUM_REQUESTS = 200_000  # samples of the joint distribution
OUT_TOKENS = 3
PROMPT_TOKEN = 0
P_VALUE_FLOOR = 1e-3    # a correct sampler fails a fixed seed with probability 1e-3
MIN_EXPECTED = 5.0      # chi-square cells with fewer expected counts are pooled

# Step time over 40..200 batch tokens probed every 8 tokens: affine, a cliff at 112 and a steeper
# slope past 120 (the jagged, step-wise SPS of paper Section 5.2). Tuned so that both cost-aware
# schedulers pick capacities that change from batch to batch and every length 0..GAMMA occurs.
_PROBES = list(range(40, 201, 8))
COST_TABLE = CostTable.from_step_times(
    _PROBES, [1 + 0.0008 * b + 0.004 * max(0, b - 120) + 0.01 * (b >= 112) for b in _PROBES])

Scheduler = Callable[[torch.Tensor], torch.Tensor]
Verifier = Callable[..., VerifyResult]


class ToyModels:
    """Warped target and draft transition tables [VOCAB, VOCAB] (row = previous token), and a
    calibrated confidence table: c(prev) = sum_x min(p_t(x|prev), p_d(x|prev)), the exact
    probability that the draft token after ``prev`` is accepted."""

    def __init__(self, params: SamplingTensors, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        target_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
        draft_logits = target_logits + torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
        self.target = warp_probs(target_logits, params)
        self.draft = warp_probs(draft_logits, params)
        self.confidence = torch.minimum(self.target, self.draft).sum(-1)

    def target_joint(self) -> torch.Tensor:
        """Exact [VOCAB] * OUT_TOKENS float64 joint of the first output tokens."""
        t = self.target.double()
        joint = t[PROMPT_TOKEN]
        for _ in range(OUT_TOKENS - 1):
            joint = joint[..., None] * t.view(*([1] * (joint.dim() - 1)), VOCAB, VOCAB)
        return joint


def speculative_decode(models: ToyModels, schedule: Scheduler, verifier: Verifier = rejection_sample,
                       num_requests: int = NUM_REQUESTS, seed: int = 1) -> torch.Tensor:
    """[num_requests, OUT_TOKENS] int64 first output tokens of independent requests, all with
    the same prompt, decoded in batches of BATCH requests per scheduler call. Requests that
    already have OUT_TOKENS tokens keep decoding until the slowest is done, so every scheduler
    call sees a full batch."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(num_requests)
    out = torch.full((num_requests, OUT_TOKENS), -1, dtype=torch.int64)
    count = torch.zeros(num_requests, dtype=torch.int64)
    last = torch.full((num_requests,), PROMPT_TOKEN, dtype=torch.int64)
    while bool((count < OUT_TOKENS).any()):
        context = [last]                              # x_0 = last committed token
        for _ in range(GAMMA):
            u = torch.rand(num_requests, generator=gen)
            context.append(sample_from_probs(models.draft[context[-1]], u))
        context = torch.stack(context, dim=1)        # [N, GAMMA + 1]
        confidence = models.confidence[context[:, :GAMMA]]  # c_k depends on x_{k-1}
        lengths = torch.cat([schedule(c) for c in confidence.split(BATCH)])
        result = verifier(models.target[context], context[:, 1:].contiguous(),
                          models.draft[context[:, :GAMMA]], lengths,
                          torch.rand(num_requests, GAMMA, generator=gen),
                          torch.rand(num_requests, generator=gen))
        for j in range(GAMMA + 1):
            slot = count + j
            emit = (j < result.num_tokens) & (slot < OUT_TOKENS)
            out[rows[emit], slot[emit]] = result.tokens[emit, j]
        last = result.tokens[rows, result.num_tokens - 1]
        count += result.num_tokens
    return out


def joint_p_value(tokens: torch.Tensor, expected_joint: torch.Tensor) -> float:
    """Chi-square p-value of the empirical joint against ``expected_joint``; cells with
    expected count < MIN_EXPECTED are pooled. Fails outright on a zero-probability outcome."""
    n = tokens.shape[0]
    cell = sum(tokens[:, i] * VOCAB ** (OUT_TOKENS - 1 - i) for i in range(OUT_TOKENS))
    observed = torch.bincount(cell, minlength=VOCAB ** OUT_TOKENS).double()
    expected = expected_joint.flatten() / expected_joint.sum() * n
    assert observed[expected == 0].sum() == 0, "emitted a sequence the target gives zero probability"
    small = expected < MIN_EXPECTED
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def _fixed_length(length: int) -> Scheduler:
    return lambda c: torch.full((c.shape[0],), length, dtype=torch.int64)


def _recording(schedule: Scheduler) -> tuple[Scheduler, torch.Tensor]:
    """``schedule`` plus a [GAMMA + 1] histogram of the lengths it returns."""
    seen = torch.zeros(GAMMA + 1, dtype=torch.int64)

    def wrapped(confidence: torch.Tensor) -> torch.Tensor:
        lengths = schedule(confidence)
        seen.add_(torch.bincount(lengths, minlength=GAMMA + 1))
        return lengths
    return wrapped, seen


@pytest.mark.lossless
@pytest.mark.parametrize("name", ["algorithm1", "async", "static", "threshold"])
def test_scheduled_decoding_is_lossless(name):
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0))
    schedule, seen = _recording(make_scheduler(name, gamma=GAMMA, cost_table=COST_TABLE,
                                               threshold=0.5))
    tokens = speculative_decode(models, schedule)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR
    # The check only means something if lengths really vary with the drafted tokens.
    assert (seen > 0).sum() >= (1 if name == "static" else 4), seen.tolist()


@pytest.mark.lossless
def test_lossless_with_top_k_top_p_warping():
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0, top_k=4, top_p=0.9), seed=2)
    assert (models.target == 0).any() and (models.draft == 0).any()
    schedule, seen = _recording(make_scheduler("algorithm1", gamma=GAMMA, cost_table=COST_TABLE))
    tokens = speculative_decode(models, schedule, seed=3)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR
    assert (seen > 0).sum() >= 3, seen.tolist()


@pytest.mark.lossless
def test_lossless_with_random_fixed_lengths():
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0), seed=4)
    gen = torch.Generator().manual_seed(5)
    tokens = speculative_decode(
        models, lambda c: torch.randint(0, GAMMA + 1, (c.shape[0],), generator=gen), seed=6)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR


def test_greedy_decoding_emits_the_target_argmax_chain():
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=0.0), seed=7)
    tokens = speculative_decode(models, _fixed_length(GAMMA), num_requests=4 * BATCH)
    chain = [PROMPT_TOKEN]
    for _ in range(OUT_TOKENS):
        chain.append(int(models.target[chain[-1]].argmax()))
    assert (tokens == torch.tensor(chain[1:])).all()


def _resample_from_target(target_probs, draft_tokens, draft_probs, lengths, u_accept, u_final):
    """Deliberately wrong: accepts like the real verifier but draws the token after a
    rejection from p_t instead of the residual max(0, p_t - p_d)."""
    result = rejection_sample(target_probs, draft_tokens, draft_probs, lengths, u_accept, u_final)
    rows = torch.arange(lengths.shape[0])
    final = sample_from_probs(target_probs[rows, result.num_accepted], u_final)
    result.tokens[rows, result.num_accepted] = final
    return result


@pytest.mark.lossless
def test_check_rejects_wrong_residual():
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0))
    tokens = speculative_decode(models, _fixed_length(GAMMA), verifier=_resample_from_target)
    assert joint_p_value(tokens, models.target_joint()) < 1e-12


@pytest.mark.lossless
def test_check_rejects_anticipating_scheduler():
    """Paper Appendix counterexample: admitting x_1 only when c_2, which depends on x_1
    itself, is high biases the output even though every verification step is exact."""
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0))
    high = models.confidence.median()
    tokens = speculative_decode(
        models, lambda c: torch.where(c[:, 1] > high, GAMMA, 0), seed=8)
    assert joint_p_value(tokens, models.target_joint()) < 1e-12


# ---- proposers beside the drafter: pruned draft vocabulary, prompt lookup, hybrid pool ----

LOOKUP_SURVIVAL = 0.8   # a calibrated-looking lookup survival, deliberately not the exact one


def _proposer_models(seed: int, lookup_rows: range, pruned: bool) -> ToyModels:
    """ToyModels whose draft after prev in ``lookup_rows`` is prompt lookup's: a one-hot at a
    token fixed by the context ((prev + 1) % VOCAB), survival LOOKUP_SURVIVAL; other rows
    are the drafter's, with ``pruned`` its draft vocabulary lacking the last token (the
    target keeps mass there, which only the residual can emit)."""
    models = ToyModels(SamplingTensors.uniform(VOCAB, temperature=1.0), seed=seed)
    if pruned:
        models.draft[:, -1] = 0.0
        models.draft /= models.draft.sum(-1, keepdim=True)
        models.confidence = torch.minimum(models.target, models.draft).sum(-1)
    for prev in lookup_rows:
        models.draft[prev] = torch.nn.functional.one_hot(torch.tensor((prev + 1) % VOCAB),
                                                         VOCAB).float()
        models.confidence[prev] = LOOKUP_SURVIVAL
    return models


@pytest.mark.lossless
def test_lossless_with_pruned_draft_vocabulary():
    models = _proposer_models(seed=9, lookup_rows=range(0), pruned=True)
    assert float(models.target[:, -1].min()) > 0.01        # target mass outside the draft vocab
    schedule, seen = _recording(make_scheduler("algorithm1", gamma=GAMMA, cost_table=COST_TABLE))
    tokens = speculative_decode(models, schedule, seed=10)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR
    assert (seen > 0).sum() >= 3, seen.tolist()


@pytest.mark.lossless
@pytest.mark.parametrize("name", ["static", "async"])
def test_lossless_with_prompt_lookup_drafts(name):
    """Every draft one-hot (lookup alone): accepted with probability p_t(x)."""
    models = _proposer_models(seed=11, lookup_rows=range(VOCAB), pruned=False)
    schedule, seen = _recording(make_scheduler(name, gamma=GAMMA, cost_table=COST_TABLE))
    tokens = speculative_decode(models, schedule, seed=12)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR
    assert seen[1:].sum() > 0, seen.tolist()


@pytest.mark.lossless
@pytest.mark.parametrize("name", ["algorithm1", "async"])
def test_lossless_with_hybrid_survival_pool(name):
    """Hybrid: lookup rows (one-hot, fixed survival) and pruned-vocabulary drafter rows
    (exact overlap survival) ranked in one pool by a cost-aware scheduler (Appendix A)."""
    models = _proposer_models(seed=13, lookup_rows=range(VOCAB // 2), pruned=True)
    schedule, seen = _recording(make_scheduler(name, gamma=GAMMA, cost_table=COST_TABLE))
    tokens = speculative_decode(models, schedule, seed=14)
    assert joint_p_value(tokens, models.target_joint()) > P_VALUE_FLOOR
    assert (seen > 0).sum() >= 3, seen.tolist()
