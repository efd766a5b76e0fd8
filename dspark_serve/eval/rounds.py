"""Chained speculative rounds with fixed gamma and full verification (the paper's Table 1
setting: scheduler off), recording every round's confidence logits and acceptance outcome.

This is a lean loop rather than ``LLMEngine``: it needs the raw confidence logits paired with
the real rejection-sampling outcome of the same round (for STS labels, ECE/AUROC and the
threshold sweep), a block that is never shortened by max_tokens, and nothing of serving
(penalties, stop strings, detokenisation, admission). Per round, for each active request:
draft gamma tokens from the anchor (``DSparkDrafter.draft``), run the target once over
[anchor, x_1..x_gamma] (``TargetModel.forward``), warp both sides identically
(``warp_probs``) and verify all gamma drafts (``rejection_sample``); the anchor and accepted
drafts enter the drafter's context, the recovered or bonus token becomes the next anchor.
Requests stop at EOS or after ``max_new_tokens`` committed tokens (the last round may pass it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.sampling.warping import warp_probs
from dspark_serve.types import SamplingTensors
from dspark_serve.verify.rejection import rejection_sample


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
        uniforms = lambda rows, n: torch.stack([torch.rand(n, generator=gens[r], device=dev)
                                                for r in rows.tolist()])
        sampling = SamplingTensors.uniform(b, temperature, top_p=top_p, device=dev)
        # prefill: every prompt token, logits of the last one
        lens = torch.tensor([len(p) for p in chunk], device=dev)
        flat_slots = slots.repeat_interleave(lens)
        flat_pos = torch.cat([torch.arange(n, device=dev) for n in lens.tolist()])
        out = target.forward(torch.tensor(sum(chunk, []), device=dev), flat_slots, flat_pos, kv,
                             torch.cumsum(lens, 0) - 1)
        drafter.extend_context(cache, flat_slots, flat_pos, out.taps)
        all_rows = torch.arange(b, device=dev)
        anchor = sample_from_probs(warp_probs(out.logits, sampling), uniforms(all_rows, 1)[:, 0])
        anchor_pos, count = lens.clone(), torch.ones(b, dtype=torch.int64, device=dev)
        active = ~torch.isin(anchor, eos) & (count < max_new_tokens)
        offsets = torch.arange(gamma + 1, device=dev)
        while bool(active.any()):
            rows = all_rows[active]
            r = rows.numel()
            s_rows = sampling.select(rows)
            u = uniforms(rows, drafter.gamma + gamma + 1)
            block = drafter.draft(cache, slots[rows], anchor[rows], anchor_pos[rows], s_rows,
                                  u[:, :drafter.gamma].contiguous())
            drafts, draft_probs = block.tokens[:, :gamma], block.probs[:, :gamma]
            ids = torch.cat([anchor[rows, None], drafts], 1)
            pos = anchor_pos[rows, None] + offsets
            out = target.forward(ids.flatten(), slots[rows].repeat_interleave(gamma + 1),
                                 pos.flatten(), kv)
            target_probs = warp_probs(out.logits, s_rows.repeat_interleave(gamma + 1))
            res = rejection_sample(target_probs.view(r, gamma + 1, -1), drafts, draft_probs,
                                   torch.full((r,), gamma, device=dev),
                                   u[:, drafter.gamma:-1].contiguous(), u[:, -1].contiguous())
            n = res.num_accepted
            logs.append((block.conf_logits[:, :gamma].float().cpu(), n.cpu(), (rows + first).cpu()))
            committed = offsets[None, :] <= n[:, None]                   # anchor + accepted drafts
            flat = committed.flatten()
            drafter.extend_context(cache, slots[rows].repeat_interleave(gamma + 1)[flat],
                                   pos[committed], out.taps[flat])
            new = res.tokens.masked_fill(~committed, -1)
            anchor[rows] = res.tokens.gather(1, n[:, None]).squeeze(1)
            anchor_pos[rows] += n + 1
            count[rows] += n + 1
            done = torch.isin(new, eos).any(1) | (count[rows] >= max_new_tokens)
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
