"""Asynchronous scheduler (paper Section 5.2): capacity K from the survival two steps back by
global search (crossing SPS cliffs), top-K admission of the current step, history rules."""
import math

import pytest
import torch

from dspark_serve.scheduling import AsyncScheduler, CostTable, make_scheduler
from dspark_serve.scheduling.admission import survival
from dspark_serve.scheduling.async_scheduler import (MAX_PROBE_INTERVAL,
                                                    MAX_PROPOSAL_PROBE_INTERVAL, PROBE_INTERVAL,
                                                    PROPOSAL_EMA, PROPOSAL_MARGIN,
                                                    PROPOSAL_PROBE_INTERVAL)

FLAT = CostTable((1, 4096), (1.0, 1.0), 4096)


def test_capacity_is_the_global_optimum_on_jagged_tables(brute_force, jagged_table):
    gen = torch.Generator().manual_seed(1)
    crossed_cliff = 0
    for case in range(120):
        num_req, gamma = int(torch.randint(1, 4, (1,), generator=gen)), int(
            torch.randint(1, 4, (1,), generator=gen))
        table = jagged_table(num_req * (gamma + 1), gen)
        history = torch.empty(num_req, gamma).uniform_(0.3, 1.0, generator=gen)
        sched = make_scheduler("async", gamma=gamma, cost_table=table)
        sched(history)                                  # step t-2
        sched(torch.rand(num_req, gamma, generator=gen))  # step t-1: must not matter
        _, best_k = brute_force(survival(history), table)
        assert sched.capacity(num_req) == best_k, case
        early = make_scheduler("algorithm1", gamma=gamma, cost_table=table)(history)
        crossed_cliff += best_k > int(early.sum())
    assert crossed_cliff > 10   # the jagged cases really have later, higher maxima


def test_crosses_the_cliff_that_stops_algorithm1():
    table = CostTable((1, 2, 4), (1.0, 0.5, 0.5), 4)
    sched = make_scheduler("async", gamma=3, cost_table=table)
    conf = torch.tensor([[0.9, 0.9, 0.9]])
    sched(conf)
    sched(conf)
    assert sched.capacity(1) == 3   # Theta_3 = 1.7195 > Theta_0 = 1.0 > Theta_1 = 0.95
    assert sched(conf).tolist() == [3]


def test_capacity_uses_the_step_two_back():
    table = CostTable((1, 2, 3), (1.0, 0.5, 0.45), 3)   # the paper's Appendix A curve
    sched = make_scheduler("async", gamma=2, cost_table=table)
    high, low = torch.tensor([[0.8, 0.9]]), torch.tensor([[0.8, 0.0]])
    # No history: all slots assumed to survive, K = argmax (1 + k) * SPS(1 + k) = 2 (1.35).
    assert sched.capacity(1) == 2
    assert sched(low).tolist() == [1]      # K = 2, but a zero-survival slot is never admitted
    assert sched.capacity(1) == 2          # still fewer than two steps of history
    assert sched(high).tolist() == [2]
    assert sched.capacity(1) == 0          # from `low`: Theta = 1.0, 0.9, 0.81
    assert sched(high).tolist() == [0]
    assert sched.capacity(1) == 2          # from `high`: Theta = 1.0, 0.9, 1.134
    sched.reset()
    assert sched.capacity(1) == 2


def test_top_k_admission_respects_rank_and_prefixes():
    gen = torch.Generator().manual_seed(2)
    for case in range(50):
        num_req, gamma = int(torch.randint(1, 40, (1,), generator=gen)), 6
        conf = torch.rand(num_req, gamma, generator=gen).clamp(min=0.05)
        conf[conf > 0.8] = 1.0                          # exact ties inside and across rows
        sched = AsyncScheduler(gamma, FLAT, max_batch_tokens=num_req + int(
            torch.randint(0, num_req * gamma + 1, (1,), generator=gen)))
        k = sched.capacity(num_req)
        lengths = sched(conf)
        surv = survival(conf)
        admitted = torch.arange(gamma)[None, :] < lengths[:, None]
        assert int(lengths.sum()) == k, case
        if 0 < k < num_req * gamma:
            assert surv[admitted].min() >= surv[~admitted].max(), case


@pytest.mark.parametrize("conf, k, expected", [
    ([[1.0, 1.0, 0.5], [1.0, 0.5, 1.0]], 3, [2, 1]),   # a = [[1, 1, .5], [1, .5, .5]]
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 1, [1, 0]),   # all tied: position, then request
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 2, [1, 1]),
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 3, [2, 1]),
    ([[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]], 2, [1, 1]),
    ([[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]], 3, [1, 2]),
])
def test_ties_break_by_position_then_request(conf, k, expected):
    sched = AsyncScheduler(3, FLAT, max_batch_tokens=2 + k)   # first step: K = budget - R
    assert sched(torch.tensor(conf)).tolist() == expected


def test_request_count_change_stretches_the_history():
    gen = torch.Generator().manual_seed(3)
    for case in range(30):
        table = jagged_table_for_stretch(gen)
        rows = torch.empty(2, 4).uniform_(0.2, 1.0, generator=gen)
        for copies in (2, 3):
            stretched = make_scheduler("async", gamma=4, cost_table=table)
            stretched(rows)
            stretched(rows)
            repeated = make_scheduler("async", gamma=4, cost_table=table)
            repeated(rows.repeat(copies, 1))
            repeated(rows.repeat(copies, 1))
            # Two requests' history read for 2*copies requests = each request repeated.
            assert stretched.capacity(2 * copies) == repeated.capacity(2 * copies), case
        shrunk = stretched.capacity(1)
        assert 0 <= shrunk <= 4


def jagged_table_for_stretch(gen: torch.Generator) -> CostTable:
    sps = torch.rand(30, generator=gen).add(0.1).cumsum(0).flip(0)   # decreasing, random steps
    return CostTable(tuple(range(1, 31)), tuple(sps.tolist()), 30)


def test_budget_and_errors():
    sched = make_scheduler("async", gamma=4, cost_table=FLAT, max_batch_tokens=10)
    conf = torch.full((3, 4), 0.9)
    for _ in range(3):
        assert int((1 + sched(conf)).sum()) == 10
    with pytest.raises(ValueError, match="more than the limit"):
        sched(torch.full((11, 4), 0.9))
    with pytest.raises(ValueError, match="more than the limit"):
        sched.capacity(11)
    with pytest.raises(ValueError, match="num_requests"):
        sched.capacity(-1)
    assert sched.capacity(0) == 0
    assert sched(torch.zeros(0, 4)).tolist() == []


def test_drafting_time_enters_the_throughput():
    # one request, survival a = 0.5, 0.25 (S = 0, 0.5, 0.75); SPS = 1.0, 0.9, 0.6
    table = CostTable((1, 2, 3), (1.0, 0.9, 0.6), 3)
    sched = make_scheduler("async", gamma=2, cost_table=table)
    conf = torch.tensor([[0.5, 0.5]])
    sched(conf)
    sched(conf)
    # no drafting time: Theta = (1 + S_K) SPS(1 + K) = 1.0, 1.35, 1.05
    assert sched.capacity(1) == 1 and sched.worth_drafting(1)
    # d = 5 s: Theta = (1 + S_K) / (1 / SPS + 5) = 0.167, 0.2455, 0.2625, so K = 2; but a
    # plain step gives 1 * SPS(1) = 1.0 tokens/s: drafting does not pay
    sched.observe_draft(1, 5.0)
    assert sched.capacity(1) == 2
    # probes after 16, 32, 64, 128, 256, 256 skipped steps (back-off while drafting loses)
    intervals = [PROBE_INTERVAL * 2 ** i for i in range(5)] + [MAX_PROBE_INTERVAL]
    assert intervals[-2] == MAX_PROBE_INTERVAL
    expected = sum(([False] * (n - 1) + [True] for n in intervals), [])
    assert [sched.worth_drafting(1) for _ in range(len(expected))] == expected
    # drafting pays again (no drafting time): the interval is back to PROBE_INTERVAL
    for _ in range(60):
        sched.observe_draft(1, 0.0)       # the moving average decays to ~5 * 0.75 ** 60 s
    assert sched.worth_drafting(1)
    for _ in range(60):
        sched.observe_draft(1, 5.0)
    assert [sched.worth_drafting(1) for _ in range(PROBE_INTERVAL)] == (
        [False] * (PROBE_INTERVAL - 1) + [True])
    # d = 0.5 s: Theta_1 = 1.5 / (1 / 0.9 + 0.5) = 0.931 < 1.0 but the survival of a better
    # drafter (a = 0.9, 0.81) gives Theta_1 = 1.9 / 1.611 = 1.18 > 1.0
    sched.reset()
    sched.observe_draft(1, 0.5)
    sched(conf)
    sched(conf)
    assert not sched.worth_drafting(1)
    good = torch.tensor([[0.9, 0.9]])
    sched(good)
    sched(good)
    assert sched.worth_drafting(1)


def test_drafting_time_moving_average_and_nearest_r():
    sched = make_scheduler("async", gamma=2, cost_table=FLAT)
    sched.observe_draft(4, 0.1)
    sched.observe_draft(4, 0.2)              # 0.1 + 0.25 * (0.2 - 0.1)
    sched.observe_draft(16, 0.4)
    assert sched.draft_seconds(4) == pytest.approx(0.125)
    assert sched.draft_seconds(1) == pytest.approx(0.125)   # nearest measured R is 4
    assert sched.draft_seconds(12) == pytest.approx(0.4)    # 16 is nearer than 4
    assert sched.draft_seconds(10) == pytest.approx(0.125)  # a tie goes to the smaller R
    assert sched.draft_seconds(0) == 0.0    # no drafter rows: no drafting time
    sched.reset()
    assert sched.draft_seconds(4) == 0.0


def test_draft_width_is_the_capacity_plus_one():
    """Flat step prices: K = the slots with positive survival two drafted steps back, so the
    drafter drafts K + 1 positions (at most gamma) and K can grow by one per drafted step."""
    sched = make_scheduler("async", gamma=4, cost_table=FLAT)
    assert sched.draft_width(1) == 4                  # no history: every slot assumed to survive
    cut = torch.tensor([[0.9, 0.9, 0.0, 0.0]])        # a block drafted two positions wide
    sched(cut)
    sched(cut)
    assert sched.capacity(1) == 2 and sched.draft_width(1) == 3
    sched(torch.tensor([[0.9, 0.9, 0.9, 0.0]]))       # three drafted positions, all positive
    sched(cut)
    assert sched.draft_width(1) == 4                  # K = 3 from the step two back
    assert sched.draft_width(1, torch.full((1, 4), 0.95)) == 4   # a lookup row: K = 7, capped
    assert sched.draft_width(0) == 4


def test_drafting_time_by_width():
    """Drafting times are kept per width (the nearest width measured, ties to the smaller),
    and each K pays the time of the width it drafts, min(gamma, K + 1)."""
    sched = make_scheduler("async", gamma=4, cost_table=FLAT)
    sched.observe_draft(1, 0.1, width=2)
    sched.observe_draft(1, 0.4)                       # a full block
    assert [sched.draft_seconds(1, w) for w in (1, 2, 3, 4)] == pytest.approx(
        [0.1, 0.1, 0.1, 0.4])
    assert sched.draft_seconds(1) == pytest.approx(0.4)
    # gamma 2, a = 0.5, 0.25; SPS 1: a width-1 draft is free, a width-2 one costs 10 s:
    # Theta_0..2 = 1 / 1, 1.5 / 11, 1.75 / 11, so K = 0 and one position is drafted, and
    # drafting does not pay against a plain step (1.0)
    sched = make_scheduler("async", gamma=2, cost_table=FLAT)
    conf = torch.tensor([[0.5, 0.5]])
    sched(conf)
    sched(conf)
    sched.observe_draft(1, 0.0, width=1)
    sched.observe_draft(1, 10.0, width=2)
    assert sched.capacity(1) == 0 and sched.draft_width(1) == 1
    assert not sched.worth_drafting(1)
    sched.observe_draft(1, 0.0, width=2)
    for _ in range(80):
        sched.observe_draft(1, 0.0, width=2)          # the average decays to ~10 * 0.75 ** 81 s
    assert sched.capacity(1) == 2 and sched.draft_width(1) == 2 and sched.worth_drafting(1)


def test_lookup_only_steps_pay_no_drafting_time():
    """A step whose rows are all lookup rows (known) sizes K without the drafter's measured
    time: that time, added to every K's step time, would make verifying look cheaper than it
    is. One lookup row, survival 0.6, 0.36; SPS = 1.0, 0.5, 0.45: Theta_0..2 = 1.0, 0.8, 0.882
    -> K = 0; with a phantom 5 s per step (1 + S_K) / (1 / SPS + 5) would give K = 2."""
    table = CostTable((1, 2, 3), (1.0, 0.5, 0.45), 3)
    sched = make_scheduler("async", gamma=2, cost_table=table)
    sched.observe_draft(1, 5.0)
    lookup = torch.tensor([[0.6, 0.6]])
    assert sched(lookup, torch.tensor([True])).tolist() == [0]


def test_known_rows_size_k_from_this_step():
    """A lookup row's survival is fixed before drafting: K counts it at once, while the
    drafter rows still come from two steps back; only drafter rows enter the history."""
    table = CostTable((1, 2, 3, 4, 5), (1.0, 0.5, 0.5, 0.45, 0.45), 5)
    sched = make_scheduler("async", gamma=2, cost_table=table)
    drafter_low = torch.tensor([[0.8, 0.0]])
    for _ in range(2):
        sched(drafter_low)                               # drafter history: a = 0.8, 0
    assert sched.capacity(1) == 0                        # Theta = 1.0, 0.9
    lookup, drafter = torch.tensor([[0.95, 0.95]]), torch.tensor([[0.9, 0.9]])
    known = torch.tensor([True, False])
    # R = 2; pool: lookup 0.95, 0.9025 (now) + drafter 0.8 (lagged):
    # Theta_0..3 = 2 * 0.5, 2.95 * 0.5, 3.8525 * 0.45, 4.6525 * 0.45 -> K = 3
    lengths = sched(torch.cat([lookup, drafter]), known)
    assert lengths.tolist() == [2, 1]                    # top 3 by this step's survival
    # all rows known (the second found nothing): no history entry
    no_match = torch.zeros(1, 2)
    assert sched(torch.cat([lookup, no_match]), torch.tensor([True, True])).tolist() == [2, 0]
    assert sched.capacity(1) == 0                        # still the second drafter_low step
    sched(drafter_low)
    # now two back is the mixed step's drafter row (0.9, 0.81), not its lookup row
    assert sched.capacity(1) == 2                        # Theta = 1.0, 0.95, 1.355
    with pytest.raises(ValueError, match="known must be a bool tensor"):
        sched(drafter, torch.tensor([1]))


def test_worth_drafting_weighs_the_drafter_against_lookup_rows_alone():
    """The drafter runs when its rows add throughput beyond the known rows verified alone."""
    table = CostTable((1, 2, 3, 4, 5), (1.0, 1.0, 1.0, 1.0, 1.0), 5)
    sched = make_scheduler("async", gamma=2, cost_table=table)
    for _ in range(2):
        sched(torch.tensor([[0.5, 0.5]]))                # drafter: a = 0.5, 0.25
    lookup = torch.tensor([[0.9, 0.9]])
    sched.observe_draft(1, 0.0)
    assert sched.worth_drafting(1, lookup)               # a free drafter adds 0.75 tokens
    sched.observe_draft(1, 10.0)
    sched.observe_draft(1, 10.0)
    # ~4.4 s of drafting (moving average) for 0.75 expected tokens: the lookup row alone wins
    assert not sched.worth_drafting(1, lookup)


def test_verifying_pays_only_where_a_best_case_draft_beats_a_plain_step():
    """Step time proportional to B (a CPU at many users): no draft short of certain survival
    pays, so lookup need not run; a flat table: any positive survival pays. The answer
    follows served step prices."""
    linear = CostTable(tuple(range(1, 65)), tuple(1 / b for b in range(1, 65)), 64)
    best = torch.tensor([0.9, 0.8])
    assert not make_scheduler("async", gamma=2, cost_table=linear).verifying_pays(16, best)
    assert make_scheduler("async", gamma=2, cost_table=linear).verifying_pays(
        16, torch.tensor([1.0, 1.0])) is False   # certain drafts only tie: (16 + k) / (16 + k)
    sched = make_scheduler("async", gamma=2, cost_table=FLAT)
    assert sched.verifying_pays(16, best)
    assert not sched.verifying_pays(0, best)
    sched.observe_step(16, 1.0)
    sched.observe_step(48, 3.0)            # served: step time proportional to B
    assert not sched.verifying_pays(16, best)


def test_one_slow_early_proposal_does_not_close_the_gate():
    """The average is the plain mean until 1 / PROPOSAL_EMA steps are recorded: a first step
    that lost 3 plain steps (a first draft's start-up) among 199 that gained 0.88 averages
    (-3 + 199 * 0.88) / 200 and proposing goes on (an EMA seeded with -3 read -0.55)."""
    table = CostTable(tuple(range(1, 65)), tuple(1 / (8 + b / 2) for b in range(1, 65)), 64)
    sched = make_scheduler("async", gamma=7, cost_table=table)
    sched.observe_proposal(1, verified=0, accepted=0, seconds=3 * 8.5)      # net -3
    memory = round(1 / PROPOSAL_EMA)
    for _ in range(memory - 1):
        sched.observe_proposal(1, verified=2, accepted=1, seconds=0.0)
    net = 1 - 9.5 / 8.5 + 1       # 1 accepted, a 3-token verify step at 9.5 s against 8.5 s
    assert sched._proposals[1] == (pytest.approx((-3 + (memory - 1) * net) / memory), memory)
    assert sched.proposing_pays(1)


def test_proposing_stops_where_it_loses_and_probes():
    """Step time 8 + B / 2 seconds: a proposing step at R = 16 nets (accepted - verified / 2
    - seconds spent) / 16 of a plain step and weighs as 16 rounds. Proposing goes on until 1 /
    PROPOSAL_EMA rounds are averaged (13 steps of 16 users), stops while the average loses
    more than PROPOSAL_MARGIN (one probe per PROPOSAL_PROBE_INTERVAL steps), and a probe
    weighs as the rounds of the steps it stood for: one that loses keeps it closed, one that
    gains reopens it."""
    table = CostTable(tuple(range(1, 65)), tuple(1 / (8 + b / 2) for b in range(1, 65)), 64)
    sched = make_scheduler("async", gamma=7, cost_table=table)
    assert sched.proposing_pays(16)
    steps = math.ceil(1 / PROPOSAL_EMA / 16)
    for _ in range(steps - 1):
        sched.observe_proposal(16, verified=0, accepted=0, seconds=0.32)   # net -0.02
        assert sched.proposing_pays(16)
    sched.observe_proposal(16, verified=0, accepted=0, seconds=0.32)
    assert sched._proposals[16] == (pytest.approx(-0.02), 16 * steps)
    probe_after = lambda steps: [False] * (steps - 1) + [True]
    assert [sched.proposing_pays(16) for _ in range(16)] == probe_after(PROPOSAL_PROBE_INTERVAL)
    # no gain recorded since: the next probe comes after twice as many plain steps
    assert [sched.proposing_pays(15) for _ in range(2 * PROPOSAL_PROBE_INTERVAL)] == \
        probe_after(2 * PROPOSAL_PROBE_INTERVAL)                       # the nearest R decides
    assert sched.proposing_pays(1) is False        # no R nearer than 16 has an average yet
    # the probe (asked at R = 15 above) nets -0.05 and weighs as 32 steps of 16 rounds
    sched.observe_proposal(16, verified=0, accepted=0, seconds=0.8)
    weight = 1 - (1 - PROPOSAL_EMA) ** (16 * 2 * PROPOSAL_PROBE_INTERVAL)
    assert sched._proposals[16][0] == pytest.approx(-0.02 - 0.03 * weight)
    # the R = 1 step was the first plain step since that probe; the interval doubles up to
    # MAX_PROPOSAL_PROBE_INTERVAL
    interval = 4 * PROPOSAL_PROBE_INTERVAL
    assert [sched.proposing_pays(16) for _ in range(interval - 1)] == probe_after(interval)[1:]
    for _ in range(2):
        sched.observe_proposal(16, verified=0, accepted=0, seconds=0.8)
        interval = min(2 * interval, MAX_PROPOSAL_PROBE_INTERVAL)
        assert [sched.proposing_pays(16) for _ in range(interval)] == probe_after(interval)
    # a probe with 7 of 7 accepted nets (7 - 3.5) / 16 and reopens it; once proposing stops
    # paying again, the first probe comes after PROPOSAL_PROBE_INTERVAL steps again
    sched.observe_proposal(16, verified=7, accepted=7, seconds=0.0)
    assert -PROPOSAL_MARGIN < sched._proposals[16][0] and sched.proposing_pays(16)
    for _ in range(3):          # each nets -1 at weight 1 - (1 - PROPOSAL_EMA) ** 16
        sched.observe_proposal(16, verified=0, accepted=0, seconds=16.0)
    assert [sched.proposing_pays(16) for _ in range(16)] == probe_after(PROPOSAL_PROBE_INTERVAL)
    sched.reset()
    assert sched._proposals == {} and sched.proposing_pays(16)
