"""SPS(B) of the embedded engine's target forward (``TargetModel.forward`` over a
``KVCache``), and the few-second startup profile the engine turns into its cost table.

Step layout of a probe (B batch tokens, context length C): B tokens spread as evenly as
possible over R = min(B, n) requests, n the slots the profile holds (the engine's
``max_num_seqs`` by default), each request's tokens at positions C, C+1, ... of its own slot
after C cached positions filled with random keys/values. So B <= n probes look like decode
steps of B requests and larger B like verify blocks of about B / n tokens each -- the batches
the scheduler actually sends. Logits are computed for every token, as verification needs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.profiling.sps import StepFn, batch_grid, cost_table_from_profile, profile_sps

KV_FILL_STD = 0.5  # random cached keys/values: real data, never the OS's shared zero page


@contextlib.contextmanager
def target_step(model, cache, *, max_requests: int | None = None,
                seed: int = 0) -> Iterator[StepFn]:
    """A ``step(B, C)`` running ``model.forward`` on the probe layout above, holding
    ``probe_requests(cache, max_requests)`` slots of ``cache``, each with
    ``probe_room`` positions (returned on exit).

    Args:
        model: ``dspark_serve.model.target_model.TargetModel`` (or anything with its
            ``forward(input_ids, slots, positions, cache, logit_indices)`` and ``weights``).
        cache: its ``KVCache`` (e.g. the engine's own, while no request runs).
        max_requests: most requests per probe; None = all free slots.
    Raises:
        ValueError: no free slot, or (from ``step``) C + tokens per request > the room.
    """
    n = probe_requests(cache, max_requests)
    if n < 1:
        raise ValueError("the KV cache has no free slot to profile with")
    room = probe_room(cache, n)
    slots = [cache.allocate(room) for _ in range(n)]
    device = cache.k.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.weights.vocab_size
    filled = 0
    slot_ids = torch.tensor(slots, dtype=torch.int64, device=device)

    def step(batch_tokens: int, context_len: int) -> Any:
        nonlocal filled
        r = min(batch_tokens, n)
        per = [batch_tokens // r + (i < batch_tokens % r) for i in range(r)]
        if context_len + per[0] > room:
            raise ValueError(f"context {context_len} + {per[0]} tokens per request exceeds the "
                             f"{room} positions of a probe request (cache max_len "
                             f"{cache.max_len})")
        if context_len > filled:
            pos = torch.arange(filled, context_len, device=device)
            rows = cache.write_rows(slot_ids.repeat_interleave(pos.numel()), pos.repeat(n))
            for kv in (cache.k, cache.v):
                flat = kv.view(kv.shape[0], -1, kv.shape[-1])  # [layers, write_rows' rows, D]
                noise = torch.empty(flat.shape[0], rows.numel(), flat.shape[2], dtype=kv.dtype,
                                    device=device)
                flat[:, rows] = noise.normal_(0.0, KV_FILL_STD)
            filled = context_len
        counts = torch.tensor(per, dtype=torch.int64)
        tok_slots = slot_ids[:r].repeat_interleave(counts.to(device))
        starts = torch.cumsum(counts, 0) - counts
        offsets = torch.arange(batch_tokens) - starts.repeat_interleave(counts)
        positions = (context_len + offsets).to(device)
        ids = torch.randint(vocab, (batch_tokens,), generator=gen).to(device)
        return model.forward(ids, tok_slots, positions, cache, None)

    try:
        yield step
    finally:
        for s in slots:
            cache.free(s)


def probe_requests(cache, max_requests: int | None) -> int:
    """Requests a probe spreads its tokens over: free slots (at most ``max_requests``), each
    needing at least one free page."""
    n = min(cache.num_free_slots, cache.num_free_pages)
    return n if max_requests is None else min(max_requests, n)


def probe_room(cache, requests: int) -> int:
    """Positions each of ``requests`` probe requests holds: an equal share of the free
    pages, at most the cache's max_len."""
    return min(cache.max_len, cache.num_free_pages // requests * cache.page_size)


def device_sync(device: torch.device):
    """What to call after a step so its time includes the device's queued work."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def profile_cost_table(model, cache, *, max_batch_tokens: int, context_len: int = 256,
                       time_budget_s: float = 6.0, per_octave: int = 2, warmup: int = 1,
                       repeats: int = 5, max_requests: int | None = None,
                       meta: dict[str, Any] | None = None, progress: bool = False) -> CostTable:
    """The engine's startup profile (paper Section 3.2.2): SPS(B) at one context length on a
    coarse grid (``batch_grid(max_batch_tokens, per_octave)``), B ascending until
    ``time_budget_s`` seconds are spent (``profile_sps``: interleaved rounds; five, so that up
    to two rounds caught in a slow period of a shared host do not move a probe's median); the
    table keeps ``max_batch_tokens`` as its limit and extrapolates conservatively past the last
    probe measured.

    ``model`` / ``cache`` / ``max_requests`` as in ``target_step``; the cache must have
    room for ``context_len + ceil(max_batch_tokens / requests)`` positions per slot (the
    grid is cut where a probe would not fit). Raises ValueError when not even B = 1 fits.
    """
    n = max(probe_requests(cache, max_requests), 1)
    room = probe_room(cache, n)
    grid = [b for b in batch_grid(max_batch_tokens, per_octave)
            if context_len + math.ceil(b / n) <= room]
    if not grid:
        raise ValueError(f"context_len {context_len} leaves no room in the {room} positions of "
                         f"a probe request (cache max_len {cache.max_len})")
    with target_step(model, cache, max_requests=max_requests) as step:
        profile = profile_sps(step, grid, [context_len], warmup=warmup, repeats=repeats,
                              sync=device_sync(cache.k.device), time_budget_s=time_budget_s,
                              progress=progress)
    table_meta = {"requests": n, **(meta or {})}
    return cost_table_from_profile(profile, max_batch_tokens=max_batch_tokens, meta=table_meta)
