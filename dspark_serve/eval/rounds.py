"""Chained speculative rounds with fixed gamma and full verification (the paper's Table 1
setting: scheduler off), recording every round's confidence logits and acceptance outcome.

This is a lean loop rather than ``LLMEngine``: it needs the raw confidence logits paired with
the real rejection-sampling outcome of the same round (for STS labels, ECE/AUROC and the
threshold sweep), a block that is never shortened by max_tokens, and nothing of serving
(penalties, stop strings, detokenisation, admission). It reuses the engine's verification:
per round, for each active request, draft gamma tokens from the anchor
(``DSparkDrafter.draft``), run the target once over [anchor, x_1..x_gamma]
(``TargetModel.forward`` at ``SpecMetadata.logit_indices``) and verify all gamma drafts
(``TargetSampler.verify``: the same warping as the drafter, rejection sampling); the anchor and
accepted drafts enter the drafter's context, the recovered or bonus token becomes the next
anchor. The first token after the prompt is a verify row with l = 0, as in the engine.
Requests stop at EOS or after ``max_new_tokens`` committed tokens (the last round may pass it).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.sampling.sampler import draw_uniforms
from dspark_serve.types import SamplingTensors
from dspark_serve.verify.metadata import SpecMetadata
from dspark_serve.verify.target_sampler import SamplingBatch, TargetSampler


@dataclass
class Rounds:
    """N verify rounds.

    conf_logits:  [N, gamma] float32 raw confidence logits (zeros without a confidence head).
    num_accepted: [N] int64 accepted drafts n (tau = n + 1 tokens committed in the round).
    prompt_index: [N] int64 which prompt the round belongs to.
    gamma: block size; generated: tokens committed over all prompts (first token included).
    """

    conf_logits: torch.Tensor
    num_accepted: torch.Tensor
    prompt_index: torch.Tensor
    gamma: int
    generated: int


@torch.inference_mode()
def run_rounds(target: TargetModel, drafter: DSparkDrafter, prompts: list[list[int]], *,
               gamma: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
               max_new_tokens: int = 256, batch_size: int = 8, eos_ids: set[int] = frozenset(),
               seed: int = 0, progress: bool = False) -> Rounds:
    """Generate from every prompt with speculative rounds and record them.

    Args:
        prompts: token id lists (already chat-templated), each non-empty.
        gamma: draft tokens verified per round, 1..drafter.gamma (default drafter.gamma).
        temperature, top_p: sampling of draft and target (0 = greedy).
        batch_size: prompts decoded together. seed: uniforms of prompt i come from a generator
            seeded with seed + i, so results do not depend on batch_size.
    Raises:
        ValueError: bad gamma or an empty prompt.
    """
    from tqdm import tqdm

    gamma = drafter.gamma if gamma is None else gamma
    if not 1 <= gamma <= drafter.gamma:
        raise ValueError(f"gamma must be in 1..{drafter.gamma}, got {gamma}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be non-empty")
    dev = target.device
    sampler = TargetSampler(target.weights.vocab_size)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=dev)
    logs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    generated = 0
    bar = tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="rounds")
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first:first + batch_size]
        b = len(chunk)
        max_len = max(map(len, chunk)) + max_new_tokens + gamma + 2
        kv = target.new_kv_cache(b, max_len)
        cache = drafter.new_cache(b, max_len)
        slots = torch.tensor([kv.allocate() for _ in chunk], device=dev)
        gens = [torch.Generator(device=dev).manual_seed(seed + first + i) for i in range(b)]
        sampling = SamplingTensors.uniform(b, temperature, top_p=top_p, device=dev)
        rows_batch = lambda rows: SamplingBatch.plain(sampling.select(rows),
                                                      [gens[i] for i in rows.tolist()])
        # prefill: every prompt token; its last one is a verify row with l = 0
        lens = [len(p) for p in chunk]
        flat_slots = slots.repeat_interleave(torch.tensor(lens, device=dev))
        flat_pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        meta = SpecMetadata.build([e - 1 for e in accumulate(lens)], [0] * b,
                                  torch.zeros(b, 0, dtype=torch.int64, device=dev), None, 0, dev)
        out = target.forward(torch.tensor(sum(chunk, []), device=dev), flat_slots, flat_pos, kv,
                             meta.logit_indices)
        drafter.extend_context(cache, flat_slots, flat_pos, out.taps)
        all_rows = torch.arange(b, device=dev)
        verdict = sampler.verify(out.logits, meta, rows_batch(all_rows))
        anchor = torch.tensor([t[0] for t in verdict.tokens], device=dev)
        anchor_pos = torch.tensor(lens, device=dev)
        count = torch.ones(b, dtype=torch.int64, device=dev)
        active = ~torch.isin(anchor, eos) & (count < max_new_tokens)
        offsets = torch.arange(gamma + 1, device=dev)
        while bool(active.any()):
            rows = all_rows[active]
            r = rows.numel()
            batch = rows_batch(rows)
            block = drafter.draft(cache, slots[rows], anchor[rows], anchor_pos[rows],
                                  batch.sampling, draw_uniforms(batch.generators, drafter.gamma,
                                                                dev)[:, :gamma])  # as served
            drafts, draft_probs = block.tokens, block.probs
            meta = SpecMetadata.build(list(range(0, r * (gamma + 1), gamma + 1)), [gamma] * r,
                                      drafts, draft_probs, gamma, dev)
            ids = torch.cat([anchor[rows, None], drafts], 1)
            pos = anchor_pos[rows, None] + offsets
            out = target.forward(ids.flatten(), slots[rows].repeat_interleave(gamma + 1),
                                 pos.flatten(), kv, meta.logit_indices)
            verdict = sampler.verify(out.logits, meta, batch)
            n = torch.tensor(verdict.num_accepted, device=dev)
            logs.append((block.conf_logits[:, :gamma].float().cpu(), n.cpu(), (rows + first).cpu()))
            committed = offsets[None, :] <= n[:, None]                   # anchor + accepted drafts
            flat = committed.flatten()
            drafter.extend_context(cache, slots[rows].repeat_interleave(gamma + 1)[flat],
                                   pos[committed], out.taps[flat])
            anchor[rows] = torch.tensor([t[-1] for t in verdict.tokens], device=dev)
            anchor_pos[rows] += n + 1
            count[rows] += n + 1
            done = torch.tensor([any(t in eos_ids for t in tokens) for tokens in verdict.tokens],
                                device=dev) | (count[rows] >= max_new_tokens)
            active[rows] = ~done
            bar.update(int(done.sum()))
        generated += int(count.sum())
    bar.close()
    if logs:
        conf, acc, idx = (torch.cat(t) for t in zip(*logs))
    else:
        conf, acc, idx = (torch.zeros(0, gamma), torch.zeros(0, dtype=torch.int64),
                          torch.zeros(0, dtype=torch.int64))
    return Rounds(conf_logits=conf, num_accepted=acc, prompt_index=idx, gamma=gamma,
                  generated=generated)
