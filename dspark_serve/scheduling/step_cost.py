"""Served step times correcting the profiled SPS(B) (beyond the paper).

The startup profile times bare target forwards of synthetic batches at one context length. A
served step also samples, verifies and keeps books, at the context lengths its requests have,
and on a CPU the profile itself moves by 10-30 % between runs. The scheduler's choices compare
step times of nearby B (is B + 1 worth one more draft token?), so such errors decide them:
measured on a 2-core CPU, prompt lookup at 16 users verified ~3 draft tokens per step, 86 %
accepted, and still served 6 % fewer tokens/s than plain decoding, because each verified token
cost more than the profile said.

``MeasuredStepCost`` keeps, per batch size B of the served steps, a moving average of served
seconds / profiled seconds, and prices every B as its profiled seconds times the ratio at B:
linearly interpolated between the B served so far, the nearest one's outside them, 1 before
the first step. The profile keeps the shape of SPS(B) where no step has gone; a B the profile
made too cheap gets served and corrected. The corrected SPS stays non-increasing in B (a step
over more tokens never takes less time): at one user B = 3 is served a few dozen times per
thousand steps, and a slow step among them priced it above B = 4 (SPS 64.2 against 74.7),
which made verifying two lookup drafts look dearer than three. Lossless: the ratios come
from finished steps only, never from the drafts of the step being scheduled.
"""
from __future__ import annotations

import numpy as np
import torch

from dspark_serve.scheduling.cost_table import CostTable

# Weight of the newest served step in a batch size's ratio.
STEP_TIME_EMA = 0.1
# A ratio reprices the table once it has moved this far (relative) from the priced value:
# steps between repricings reuse the schedulers' cached decisions. At 2 % the noise of one
# user's CPU steps repriced ~25 % of them, and each repricing costs the next step's drafting
# decision ~0.4 ms (~1.3 % of one-user `dspark` serving); at 5 % ~6 % of them.
REPRICE_REL = 0.05


class MeasuredStepCost:
    """``CostTable``'s ``sps_range`` and ``max_batch_tokens``, corrected by served steps.

    Args:
        table: the profiled (or loaded) cost table.
    Raises:
        TypeError: ``table`` is not a CostTable.
    """

    def __init__(self, table: CostTable):
        if not isinstance(table, CostTable):
            raise TypeError(f"cost_table must be a CostTable, got {type(table).__name__}")
        self.table = table
        self.max_batch_tokens = table.max_batch_tokens
        self.version = 0          # bumps whenever the prices change
        # profiled seconds of B = 1..max_batch_tokens (index B - 1)
        self._profiled = (1.0 / table.sps_range(1, self.max_batch_tokens + 1)).tolist()
        self._ratio: dict[int, float] = {}     # B -> served / profiled seconds (average)
        self._priced: dict[int, float] = {}    # the ratios the current prices use
        # device -> corrected SPS [max_batch_tokens + 1] float64 (index B; 0 at B = 0)
        self._dense: dict[torch.device, torch.Tensor] = {}

    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Record one served step: ``batch_tokens`` B target positions (decode tokens plus
        verified drafts, no prefill), ``seconds`` of wall time outside drafting. Steps beyond
        the table's limit or without a positive time are ignored."""
        if not 1 <= batch_tokens <= self.max_batch_tokens or not seconds > 0:
            return
        ratio = seconds / self._profiled[batch_tokens - 1]
        old = self._ratio.get(batch_tokens)
        self._ratio[batch_tokens] = ratio if old is None else old + STEP_TIME_EMA * (ratio - old)
        priced = self._priced.get(batch_tokens)
        if priced is None or abs(self._ratio[batch_tokens] - priced) > REPRICE_REL * priced:
            self._priced = dict(self._ratio)
            self._dense.clear()
            self.version += 1

    def ratio(self, batch_tokens: int) -> float:
        """Served / profiled seconds the prices use at B (1.0 before any served step)."""
        if not self._priced:
            return 1.0
        known = sorted(self._priced)
        return float(np.interp(batch_tokens, known, [self._priced[b] for b in known]))

    def sps_range(self, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Corrected SPS(B) for B = start..stop-1: float64 [stop - start] (0 above the limit,
        as ``CostTable.sps_range``; same errors). Non-increasing in B: a step over more tokens
        never takes less time, so where the corrected times say otherwise (a B served a few
        times, one slow step among them) B takes the price of the cheapest larger B."""
        if not self._priced:
            return self.table.sps_range(start, stop, device)
        if not 1 <= start <= stop:
            raise ValueError(f"need 1 <= start <= stop, got start={start}, stop={stop}")
        device = torch.device(device)
        dense = self._dense.get(device)
        if dense is None:
            known = sorted(self._priced)
            grid = np.arange(1, self.max_batch_tokens + 1)
            ratios = np.interp(grid, known, [self._priced[b] for b in known])
            corrected = self.table.sps_range(1, self.max_batch_tokens + 1).numpy() / ratios
            corrected = np.maximum.accumulate(corrected[::-1])[::-1]
            dense = torch.from_numpy(np.concatenate([[0.0], corrected])).to(device)
            self._dense[device] = dense
        stop_in = min(stop, self.max_batch_tokens + 1)
        if stop <= stop_in:
            return dense[start:stop]   # a view: callers only read it, as the table's
        sps = torch.zeros(stop - start, dtype=torch.float64, device=device)
        if stop_in > start:
            sps[:stop_in - start] = dense[start:stop_in]
        return sps
