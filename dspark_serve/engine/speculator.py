"""Drafting, calibration and verify-length scheduling for the decoding requests of one step
(paper Eq 2-7, STS, Algorithm 1 / Section 5.2), with prompt lookup beside the drafter.

Proposers: the DSpark/DFlash drafter, prompt lookup (``drafter.prompt_lookup``: drafts copied
from earlier in the request's own text, one-hot draft probabilities), or both (hybrid): per
request and round, lookup where it finds a suffix match of at least ``min_match`` tokens and
its draft is expected to get more drafts accepted than the drafter's (both learnt from served
outcomes), the drafter otherwise, so the drafter only runs for the rows lookup cannot serve
better. Every row gets calibrated conditional survival c_{r,k}: the drafter's from its
confidence head through STS, c = sigmoid(z_k / T_k), a lookup row's from its match length
(``calibration.lookup``: the shipped table as a prior that served outcomes keep updating,
``observe``), and the scheduler picks l_r over the one pool.

The speculator owns the drafter's context cache (one slot per target KV slot). Committed
tokens' target taps are projected into that cache lazily, in one batch right before the next
draft: steps that do not draft (the async scheduler found drafting not worth it) then cost no
drafter work at all. Per-request caps (remaining max_tokens, the context limit, the number of
lookup tokens found) are applied by zeroing the survival of slots past the cap before
scheduling and clamping after it; they depend only on the request's state and text, never on
drafted tokens still to be verified, so verification stays lossless. With the async
scheduler the drafter drafts only its ``draft_width`` positions (the capacity K + 1, known
before drafting), and the block is padded to gamma.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dspark_serve.calibration.lookup import LookupCalibration, OnlineLookupSurvival
from dspark_serve.calibration.sts import calibrated_confidence
from dspark_serve.drafter.corpus_lookup import CorpusIndex, num_keys
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.drafter.prompt_lookup import DEFAULT_MAX_NGRAM, LookupIndex
from dspark_serve.scheduling import AsyncScheduler, make_scheduler
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.types import DraftBlock, SamplingTensors, dense_draft_probs

# Committed tokens whose taps may wait for the drafter's next draft: past this many (the
# drafter has not drafted for that long: it does not pay, as with many users), ``extend``
# gives up the drafter's context of the slots waiting (``drop_context``), so such a server
# holds a bounded backlog (~6 MB of SmolLM2 taps) and pays no projection for a drafter that
# does not run (it cost ~1.5 % of 16-user hybrid serving).
MAX_PENDING_TOKENS = 1024
# Survival of a lookup draft without a calibration file: a guess between the measured
# position-1 acceptance of SmolLM2 lookup (0.53) and later positions (0.85-0.93).
UNCALIBRATED_LOOKUP_SURVIVAL = 0.7
# Survival of a corpus-lookup draft without a calibration file (a guess near the measured
# position-1 acceptance of SmolLM2 corpus drafts, 0.2-0.8 by key).
UNCALIBRATED_CORPUS_SURVIVAL = 0.4
# Prior conditional survival of the drafter's rows in hybrid, before served outcomes (a guess
# near the shipped SmolLM2 drafter's measured 0.42-0.6 per position at T = 0).
DRAFTER_PRIOR_SURVIVAL = 0.5


@dataclass(frozen=True)
class LookupRound:
    """Lookup drafts for the R rows of one step: tokens [R][gamma] (0 past what was found),
    gain [R] expected accepted drafts of each (0.0: none) under its survival table,
    found [R] tokens found, match_len [R] survival key (0 = no draft): the matched suffix
    length of a prompt-lookup draft, ``support_key`` of a corpus draft; from_corpus [R]
    which rows the corpus drafted."""

    tokens: list[list[int]]
    gain: list[float]
    found: list[int]
    match_len: list[int]
    from_corpus: list[bool]


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup inside the speculator.

    max_ngram: longest suffix compared. min_match: with a drafter (hybrid), shortest match
    that lookup may take a row with (shorter: the drafter drafts it; longer: the drafter too
    where its served outcomes expect more accepted drafts); alone, any match drafts.
    calibration: survival table, or None (``UNCALIBRATED_LOOKUP_SURVIVAL`` everywhere).
    corpus: corpus lookup (``drafter.corpus_lookup``) offered beside prompt lookup, or None;
    a row takes whichever of the two drafts has the longer expected accepted length under
    the current survival tables. corpus_calibration: its survival table by support key, or
    None (``UNCALIBRATED_CORPUS_SURVIVAL``).
    """

    max_ngram: int = DEFAULT_MAX_NGRAM
    min_match: int = 1
    calibration: LookupCalibration | None = None
    corpus: CorpusIndex | None = None
    corpus_calibration: LookupCalibration | None = None


class Speculator:
    """Proposers (drafter, prompt lookup or both) + calibration + scheduler.

    Args:
        drafter: the drafter (its block gives up to ``drafter.gamma`` draft tokens), or None
            for prompt lookup alone.
        lookup: ``LookupConfig`` to propose by prompt lookup (alone or hybrid), or None.
        vocab_size: V of the target (draft probabilities are [R, gamma, V]).
        gamma: draft tokens used per round, 1..drafter.gamma (the drafter's block cut to
            its first gamma positions: a shorter draft costs less).
        scheduler: scheduler name (``dspark_serve.scheduling.SCHEDULER_NAMES``).
        cost_table: SPS cost table (algorithm1 / async).
        temperatures: [gamma] float32 STS temperatures, or None (T = 1).
        threshold: cut-off of the threshold scheduler.
        max_batch_tokens: cap on the verify batch B (None = none).
        num_slots, max_len: size of the drafter's context cache.
        always_draft: draft every step (``should_draft`` always True).
    Raises:
        ValueError: neither proposer, gamma out of range, temperatures of the wrong length,
            scheduler errors.
    """

    def __init__(self, drafter: DSparkDrafter | None, *, lookup: LookupConfig | None = None,
                 vocab_size: int, gamma: int, scheduler: str, cost_table: CostTable | None,
                 temperatures: torch.Tensor | None, threshold: float,
                 max_batch_tokens: int | None, num_slots: int, max_len: int,
                 always_draft: bool = False):
        if drafter is None and lookup is None:
            raise ValueError("a speculator needs a drafter, prompt lookup or both")
        max_gamma = drafter.gamma if drafter is not None else gamma
        if not 1 <= gamma <= max_gamma:
            raise ValueError(f"gamma must be in 1..{max_gamma} (the drafter's block), got {gamma}")
        if temperatures is not None and temperatures.shape != (gamma,):
            raise ValueError(f"STS calibration has {temperatures.numel()} temperatures, gamma is "
                             f"{gamma}")
        if lookup is not None and lookup.calibration is not None \
                and lookup.calibration.gamma < gamma:
            raise ValueError(f"lookup calibration covers {lookup.calibration.gamma} positions, "
                             f"gamma is {gamma}")
        self.drafter = drafter
        self.lookup = lookup
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.has_confidence = drafter is not None and drafter.confidence_head is not None
        self.temperatures = temperatures
        self.scheduler = make_scheduler(scheduler, gamma=gamma, cost_table=cost_table,
                                        threshold=threshold, max_batch_tokens=max_batch_tokens)
        self.cache = drafter.new_cache(num_slots, max_len) if drafter is not None else None
        self.always_draft = always_draft
        self.lookup_survival = None
        if lookup is not None:
            prior = (lookup.calibration.conditional if lookup.calibration is not None
                     else [[UNCALIBRATED_LOOKUP_SURVIVAL] * gamma] * lookup.max_ngram)
            self.lookup_survival = OnlineLookupSurvival(prior)
        self.corpus_survival = None
        if lookup is not None and lookup.corpus is not None:
            calibration = lookup.corpus_calibration
            if calibration is not None and calibration.gamma < gamma:
                raise ValueError(f"corpus calibration covers {calibration.gamma} positions, "
                                 f"gamma is {gamma}")
            self.corpus_survival = OnlineLookupSurvival(
                calibration.conditional if calibration is not None else
                [[UNCALIBRATED_CORPUS_SURVIVAL] * gamma] * num_keys(lookup.corpus.max_ngram))
        # conditional survival of the drafter's rows in hybrid, from their verified outcomes
        # (one key): a lookup draft expected to survive less leaves its row to the drafter.
        # Outcomes, not the confidence head, so that both sides are measured alike at the
        # served temperatures (STS is fitted at one).
        self.drafter_survival = (OnlineLookupSurvival([[DRAFTER_PRIOR_SURVIVAL] * gamma])
                                 if drafter is not None and lookup is not None else None)
        self._drafter_rows: np.ndarray | None = None    # rows the drafter drafted, last propose
        self._drafter_expected: float | None = None     # ``_drafter_gain``, until observe
        self._lookup_indexes: dict[int, LookupIndex] = {}   # per slot, its request's text
        # (decoding rows lookup drafted [N], their survival keys [N], from the corpus [N]) of
        # the last propose
        self._lookup_rounds: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # (slots [N], positions [N], a step's taps, their rows [N] or None = all) committed
        # since the last draft, in order; plain lists until ``flush`` (no tensor work in the
        # steps that do not draft)
        self._pending: list[tuple[list[int], list[int], torch.Tensor, list[int] | None]] = []
        self._pending_tokens = 0
        # (len(_pending) when reset, slot): that slot's entries before it belong to the
        # request that left it; ``flush`` drops them
        self._stale: list[tuple[int, int]] = []
        # [num_slots] bool: slots whose drafter context was given up (until a new request),
        # and the same slots as a set
        self._dropped = (torch.zeros(num_slots, dtype=torch.bool, device=self.cache.lengths.device)
                         if self.cache is not None else None)
        self._dropped_slots: set[int] = set()
        self._step_draft_seconds = 0.0    # the drafter's wall time in the current step

    def should_draft(self, num_requests: int) -> bool:
        """Whether this step proposes for its R decoding requests: the scheduler's
        ``worth_drafting`` where it has one (async: drafting must pay for its own time), else
        always; always with ``always_draft``. With prompt lookup: unless the scheduler finds
        that even lookup's best calibrated survival cannot pay for verification at this R
        (``verifying_pays``) and the drafter does not pay either; ``propose`` then decides
        whether the drafter runs, knowing the lookup rows' survival. Before all that, the
        scheduler's ``proposing_pays``: the proposing steps at this R saved at least the
        seconds they spent proposing (``observe_proposal``), or a probe is due. False means
        a plain decode step (verify lengths 0)."""
        gate = getattr(self.scheduler, "proposing_pays", None)
        if not self.always_draft and gate is not None and not gate(num_requests):
            return False
        if self.lookup is None:
            return self._drafter_pays(num_requests, None)
        decide = getattr(self.scheduler, "verifying_pays", None)
        if self.always_draft or decide is None or decide(num_requests, self._best_case()):
            return True
        return self.drafter is not None and self._drafter_pays(num_requests, None)

    def drafter_pays(self, num_requests: int) -> bool:
        """Whether the drafter runs this step for R requests that no lookup draft serves
        (the scheduler's ``worth_drafting``, a probe included); ask once per step."""
        return self._drafter_pays(num_requests, None)

    def _drafter_pays(self, num_requests: int, known: torch.Tensor | None) -> bool:
        decide = getattr(self.scheduler, "worth_drafting", None)
        return self.always_draft or decide is None or bool(decide(num_requests, known))

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's context, pending taps and lookup index included (a new request
        takes it). O(1): the slot's pending taps are dropped at the next ``flush`` (walking
        the backlog here cost ~2 ms per admitted request at 16 users, where the drafter
        rarely runs)."""
        self._lookup_indexes.pop(slot, None)
        if self.cache is None:
            return
        if self._pending:
            self._stale.append((len(self._pending), slot))
        self._dropped[slot] = False
        self._dropped_slots.discard(slot)
        self.cache.reset(torch.tensor([slot], device=self.cache.lengths.device))

    def extend(self, slots: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
               taps: torch.Tensor, rows: list[int] | None = None) -> None:
        """Add N committed tokens' target taps to the context (projected at the next
        ``propose`` or ``flush``): slots, positions [N] (lists of ints or int64 tensors), taps
        [T, C] with the tokens at ``rows`` [N] (None: taps is [N, C]). Once more than
        ``MAX_PENDING_TOKENS`` wait, their slots' contexts are given up instead
        (``drop_context``). Nothing without a drafter, nothing for slots given up. Kept as
        given until ``flush``: the steps that do not draft do no tensor work here."""
        if self.cache is None or not len(slots):
            return
        if isinstance(slots, torch.Tensor):
            slots, positions = slots.tolist(), positions.tolist()
        if self._dropped_slots:
            keep = [i for i, slot in enumerate(slots) if slot not in self._dropped_slots]
            if not keep:
                return
            slots, positions = [slots[i] for i in keep], [positions[i] for i in keep]
            rows = keep if rows is None else [rows[i] for i in keep]
        self._pending.append((slots, positions, taps, rows))
        self._pending_tokens += len(slots)
        if self._pending_tokens > MAX_PENDING_TOKENS:
            self.drop_context()

    def drop_context(self) -> None:
        """Give up the drafter's context of every slot with taps waiting: the drafter no
        longer drafts for them (prompt lookup still does) until ``reset_slot`` hands the slot
        to a new request. Keeping them would mean projecting every committed token for a
        drafter that has not drafted for ``MAX_PENDING_TOKENS`` tokens."""
        dropped = {slot for p in self._pending for slot in p[0]}
        if dropped:
            self._dropped[torch.tensor(sorted(dropped), device=self._dropped.device)] = True
            self._dropped_slots |= dropped
        self._pending, self._pending_tokens, self._stale = [], 0, []

    def flush(self) -> None:
        """Project every pending committed token into the drafter's context now (its wall
        time is drafter work: ``observe_step`` leaves it out of the step's price)."""
        if not self._pending:
            return
        start = time.perf_counter()
        device = self.cache.lengths.device
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
        slots = as_tensor([slot for p in self._pending for slot in p[0]])
        positions = as_tensor([pos for p in self._pending for pos in p[1]])
        taps = torch.cat([t if r is None else t.index_select(0, torch.tensor(r, device=t.device))
                          for _, _, t, r in self._pending]).to(device)
        if self._stale:
            entry = torch.repeat_interleave(
                torch.arange(len(self._pending), device=slots.device),
                torch.tensor([len(p[0]) for p in self._pending], device=slots.device))
            keep = torch.ones_like(slots, dtype=torch.bool)
            for entries, slot in self._stale:
                keep &= (slots != slot) | (entry >= entries)
            slots, positions, taps = slots[keep], positions[keep], taps[keep]
        self._pending, self._pending_tokens, self._stale = [], 0, []
        if slots.numel():
            self.drafter.extend_context(self.cache, slots, positions, taps)
        self._step_draft_seconds += time.perf_counter() - start

    def propose(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_positions: torch.Tensor,
                texts: list[list[int]], sampling: SamplingTensors, uniforms: torch.Tensor,
                caps: torch.Tensor, lookup_round: LookupRound | None = None,
                drafter_runs: bool | None = None) -> tuple[DraftBlock | None, torch.Tensor]:
        """Draft and schedule one round for R requests.

        Args:
            slots, anchors, anchor_positions: [R] int64.
            texts: per request its token ids so far (prompt + output; the last is the anchor),
                read by prompt lookup.
            sampling: R rows of warping parameters (same as the verifier's).
            uniforms: [R, drafter gamma (or gamma)] float32 draft uniforms.
            caps: [R] int64 most draft tokens each request may verify (0..gamma).
            lookup_round: this step's ``lookup_drafts(slots, texts)``, when the caller ran it.
            drafter_runs: this step's ``drafter_pays(R)``, when the caller asked it already
                (a step without lookup drafts: the scheduler counts each question as a step).
        Returns:
            (block: tokens [R, gamma] int64, probs [R, gamma, V] float32, conf_logits
            [R, gamma] float32; lengths [R] int64 l_r in 0..caps[r]). The block is None, and
            every length 0, when the drafter did not run and prompt lookup found nothing to
            verify or the scheduler admitted none of its drafts: a plain decode step.
        """
        r, g, device = slots.numel(), self.gamma, slots.device
        # rows the drafter may draft: those whose context it still holds (``drop_context``)
        by_drafter = (~self._dropped[slots] if self._dropped is not None
                      else torch.ones(r, dtype=torch.bool, device=device))
        if self.lookup is None:
            caps = caps * by_drafter
        else:
            found_round = lookup_round or self.lookup_drafts(slots.tolist(), texts)
            as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
            lookup_tokens, found, match_len = (as_tensor(x) for x in (
                found_round.tokens, found_round.found, found_round.match_len))
            from_corpus = torch.tensor(found_round.from_corpus, dtype=torch.bool, device=device)
            survival = self._lookup_confidence(match_len, from_corpus, g)
            if self.drafter is None:
                by_drafter &= match_len < 1
            else:
                # lookup keeps a row whose draft is expected to get more accepted than the
                # drafter's; until the drafter's outcomes are known, prompt lookup keeps its
                # matches of min_match tokens or more, the corpus none
                drafter_gain = self._drafter_gain()
                lookup_wins = (~from_corpus if drafter_gain is None else
                               torch.tensor(found_round.gain, device=device) > drafter_gain)
                by_drafter &= ~(lookup_wins & (from_corpus | (match_len >= self.lookup.min_match)))
            taken = ~by_drafter
            lookup_caps = torch.minimum(caps, found)     # lookup rows verify the tokens found
            if self.drafter is None or not (drafter_runs if drafter_runs is not None else
                                            self._drafter_pays(int(by_drafter.sum()),
                                                               survival[taken] * self._allowed(
                                                                   lookup_caps[taken]))):
                # nobody drafts: lookup takes every matched row, as prompt lookup alone does
                # (hybrid left its short matches to a drafter that did not run)
                taken = match_len > 0
                by_drafter = torch.zeros_like(by_drafter)
                caps = lookup_caps * taken
            else:
                caps = torch.where(taken, lookup_caps, caps)
            known_confidence = survival * taken[:, None]
            rows_taken = taken.nonzero().flatten().cpu().numpy()
            self._lookup_rounds = (rows_taken, match_len.cpu().numpy()[rows_taken],
                                   from_corpus.cpu().numpy()[rows_taken])
        rows = by_drafter.nonzero().flatten()
        self._drafter_rows = (rows.cpu().numpy() if self.drafter_survival is not None
                              and rows.numel() else None)
        if not rows.numel() and (self.lookup is None or not bool((caps * taken).any())):
            # Nothing to verify (no usable match, drafter off or without context): a plain
            # decode step, without the scheduling and block bookkeeping (~0.3 ms of a CPU
            # step). The scheduler would admit nothing and record no drafter history, so
            # skipping it changes no decision.
            self._lookup_rounds = self._drafter_rows = None
            return None, torch.zeros_like(caps)
        # survival of the rows the drafter does not draft, as the scheduler will see it
        known_confidence = (known_confidence if self.lookup is not None
                            else torch.ones(r, g, dtype=torch.float32, device=device))
        known_confidence = known_confidence * self._allowed(caps)
        block, width = None, g
        if rows.numel():
            width_of = getattr(self.scheduler, "draft_width", None)
            if width_of is not None and not self.always_draft:
                width = width_of(rows.numel(), known_confidence[~by_drafter])
                caps = torch.where(by_drafter, caps.clamp(max=width), caps)
            self.flush()   # catching up on skipped steps is not this draft's cost
            start = time.perf_counter()
            block = self.drafter.draft(self.cache, slots[rows], anchors[rows],
                                       anchor_positions[rows], sampling.select(rows),
                                       uniforms[rows, :width])
            if block.tokens.is_cuda:
                torch.cuda.synchronize(device)
            draft_seconds = time.perf_counter() - start
            self._step_draft_seconds += draft_seconds
            block = _pad_block(block, g)
        if block is None or rows.numel() < r:
            # lookup rows one-hot (probs None: built only where needed), drafter rows copied
            # in: [R, gamma, V] only when mixing with drafter rows that sample
            tokens = (lookup_tokens.masked_fill(~taken[:, None], 0) if self.lookup is not None
                      else torch.zeros(r, g, dtype=torch.int64, device=device))
            probs = None
            conf_logits = torch.zeros(r, g, dtype=torch.float32, device=device)
            if block is not None:
                tokens[rows] = block.tokens
                conf_logits[rows] = block.conf_logits
                if block.probs is not None:
                    probs = dense_draft_probs(tokens, None, self.vocab_size)
                    probs[rows] = block.probs
            block = DraftBlock(tokens, probs, conf_logits)
        confidence = known_confidence.clone()
        if self.has_confidence and rows.numel():
            temps = (self.temperatures if self.temperatures is not None
                     else torch.ones(g, device=device))
            confidence[rows] = calibrated_confidence(block.conf_logits[rows], temps)
        elif self.drafter is not None and rows.numel():
            confidence[rows] = 1.0      # DFlash: no confidence head
        confidence = confidence * self._allowed(caps)
        # the async scheduler sizes K from lagged drafter survival; lookup rows' is current
        lengths = (self.scheduler(confidence, ~by_drafter)
                   if isinstance(self.scheduler, AsyncScheduler) else self.scheduler(confidence))
        # this draft's time informs later steps only: its K must not depend on its own drafts
        observe = getattr(self.scheduler, "observe_draft", None)
        if observe is not None and rows.numel():
            observe(rows.numel(), draft_seconds, width)
        lengths = torch.minimum(lengths, caps)
        if not rows.numel() and not bool(lengths.any()):
            # lookup drafts only, none admitted: a plain decode step, as when lookup finds
            # nothing (the verify bookkeeping of an empty round cost ~0.4 ms at one user)
            self._lookup_rounds = self._drafter_rows = None
            return None, lengths
        return block, lengths

    def observe_step(self, batch_tokens: int | None, seconds: float) -> None:
        """End of an engine step: its wall time (seconds) less this step's drafting prices B
        target positions for the scheduler (``AsyncScheduler.observe_step``). batch_tokens:
        the step's positions, or None when prefill tokens shared it (not a decode step's
        price)."""
        draft, self._step_draft_seconds = self._step_draft_seconds, 0.0
        observe = getattr(self.scheduler, "observe_step", None)
        if observe is not None and batch_tokens is not None:
            observe(batch_tokens, seconds - draft)

    def _lookup_confidence(self, keys: torch.Tensor, from_corpus: torch.Tensor,
                           gamma: int) -> torch.Tensor:
        """[R, gamma] float32 conditional survival of lookup rows: survival keys [R] int64
        (0 = no draft), from_corpus [R] bool (key is a corpus ``support_key``)."""
        survival = self.lookup_survival.confidence(keys * ~from_corpus, gamma)
        if self.corpus_survival is not None and bool(from_corpus.any()):
            survival = torch.where(from_corpus[:, None],
                                   self.corpus_survival.confidence(keys * from_corpus, gamma),
                                   survival)
        return survival

    def _best_case(self) -> torch.Tensor:
        """[gamma] conditional survival of a row at least as likely to survive as any lookup
        or corpus row (``OnlineLookupSurvival.best_case``)."""
        best = self.lookup_survival.best_case(self.gamma)
        if self.corpus_survival is None:
            return best
        cum = torch.maximum(best.double().cumprod(0),
                            self.corpus_survival.best_case(self.gamma).double().cumprod(0))
        return (cum / torch.cat([cum.new_ones(1), cum[:-1]]).clamp(min=1e-12)).clamp(0, 1).float()

    def _allowed(self, caps: torch.Tensor) -> torch.Tensor:
        """[R, gamma] bool: slot k of row r may be verified (k < caps[r])."""
        return torch.arange(self.gamma, device=caps.device)[None, :] < caps[:, None]

    def lookup_drafts(self, slots: list[int], texts: list[list[int]]) -> LookupRound:
        """Prompt lookup for every row (slot, its text so far), through the slot's
        ``LookupIndex``, and corpus lookup beside it where there is a corpus: a row takes the
        draft with the longer expected accepted length under the current survival tables.
        Plain Python, so a step where nothing matches costs no tensor work. Raises
        AttributeError without prompt lookup."""
        rows, gains, found, keys, from_corpus = [], [], [], [], []
        corpus = self.lookup.corpus
        own_gain = _expected_lengths(self.lookup_survival.table(), self.gamma)
        if corpus is not None:
            corpus_gain = _expected_lengths(self.corpus_survival.table(), self.gamma)
            corpus_best = max(corpus_gain(key, self.gamma)
                              for key in range(1, self.corpus_survival.table().shape[0] + 1))
        for slot, text in zip(slots, texts):
            index = self._lookup_indexes.get(slot)
            if index is None:
                index = self._lookup_indexes[slot] = LookupIndex(self.lookup.max_ngram)
            draft = index.draft(text, self.gamma)
            tokens, key, by_corpus = draft.tokens, draft.match_len, False
            gain = own_gain(key, len(tokens))
            if corpus is not None and gain < corpus_best:
                other = corpus.draft(text, self.gamma)
                other_gain = corpus_gain(other.key, len(other.tokens))
                if other.tokens and other_gain > gain:
                    tokens, key, by_corpus, gain = other.tokens, other.key, True, other_gain
            rows.append(tokens + [0] * (self.gamma - len(tokens)))
            gains.append(gain)
            found.append(len(tokens))
            keys.append(key)
            from_corpus.append(by_corpus)
        return LookupRound(rows, gains, found, keys, from_corpus)

    def observe_proposal(self, lengths: torch.Tensor, num_accepted: list[int],
                         seconds: float) -> None:
        """A step that proposed (``should_draft`` said yes): lengths [R] int64 verified,
        num_accepted [R] drafts accepted per row, seconds spent proposing; for the
        scheduler's ``proposing_pays``, where it has one."""
        observe = getattr(self.scheduler, "observe_proposal", None)
        if observe is not None:
            observe(lengths.numel(), int(lengths.sum()), sum(num_accepted), seconds)

    def observe(self, lengths: torch.Tensor, num_accepted: list[int]) -> None:
        """Count the verified outcome of the last ``propose``'s lookup rows, and in hybrid its
        drafter rows, into their survival (``OnlineLookupSurvival``): lengths [R] int64 as
        verified (after any grammar shortening), num_accepted [R] drafts accepted per row.
        No-op without prompt lookup."""
        lookup_rounds, drafter_rows = self._lookup_rounds, self._drafter_rows
        self._lookup_rounds = self._drafter_rows = None
        if lookup_rounds is None and drafter_rows is None:
            return
        lengths, num_accepted = lengths.cpu().numpy(), np.asarray(num_accepted, dtype=np.int64)
        if drafter_rows is not None:
            verified = lengths[drafter_rows]
            keep = verified > 0
            if keep.any():
                self.drafter_survival.observe(np.ones(int(keep.sum()), dtype=np.int64),
                                              verified[keep], num_accepted[drafter_rows][keep])
                self._drafter_expected = None
        if lookup_rounds is None:
            return
        rows, keys, from_corpus = lookup_rounds
        verified, accepted = lengths[rows], num_accepted[rows]
        for survival, mine in ((self.lookup_survival, ~from_corpus),
                               (self.corpus_survival, from_corpus)):
            keep = mine & (verified > 0)
            if keep.any():
                survival.observe(keys[keep], verified[keep], accepted[keep])

    def _drafter_gain(self) -> float | None:
        """Expected accepted drafts of a drafter row in hybrid (its served outcomes' survival
        over gamma positions), or None before any was verified. Cached until ``observe``
        (asked every step)."""
        if self._drafter_expected is None and self.drafter_survival.reached.any():
            self._drafter_expected = _expected_lengths(self.drafter_survival.table(),
                                                       self.gamma)(1, self.gamma)
        return self._drafter_expected


def _pad_block(block: DraftBlock, gamma: int) -> DraftBlock:
    """A block of w < gamma draft positions ([R, w] tokens, [R, w, V] probs or None, [R, w]
    confidence logits) widened to gamma with zeros (positions past w are never verified)."""
    missing = gamma - block.tokens.shape[1]
    if missing <= 0:
        return block
    pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], missing, *t.shape[2:])], dim=1)
    return DraftBlock(pad(block.tokens), None if block.probs is None else pad(block.probs),
                      pad(block.conf_logits))


def _expected_lengths(table: torch.Tensor, gamma: int):
    """``gain(key, found)``: expected accepted drafts of a row with survival key ``key`` (0: no
    draft) and ``found`` drafts under a [max_key, >= gamma] conditional survival table."""
    cum = table[:, :gamma].double().cumprod(1).cumsum(1).tolist()
    last = len(cum)
    return lambda key, found: cum[min(key, last) - 1][found - 1] if key > 0 and found > 0 else 0.0
