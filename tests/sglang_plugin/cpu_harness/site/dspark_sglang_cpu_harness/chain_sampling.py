"""Chain rejection sampling in torch: a drop-in for sglang 0.5.23's Triton
``chain_speculative_sampling_triton`` (``kernels/ops/speculative/reject_sampling.py``,
``speculative_sampling_classic_kernel``, chain mode), which DSPARK's accept step always calls
(``kernels/ops/speculative/dspark/dspark_accept.py``, ``_accept_sampling_core``), so T > 0 and
min-p can run on a CPU. No sglang import: unit-tested on its own.

Per request, draft d_s (s = 1..gamma, candidate slot s) is accepted while all earlier ones were
and u_s * q_s(d_s) < p_s(d_s), with q a probability (0 < q <= 1): p_s, q_s are the target and
draft distributions at verify row s - 1. The token after the accepted prefix of length n is
drawn from p_n when every draft was accepted, else from the residual max(p_n - q_n, 0)
(non-probability q entries count as 0), by inverse CDF with the final uniform.
"""
from __future__ import annotations

import torch


def chain_speculative_sampling(predicts, accept_index, accept_token_num, candidates,
                               retrive_index, retrive_next_token, retrive_next_sibling,
                               uniform_samples, uniform_samples_for_final_sampling,
                               target_probs, draft_probs, threshold_single, threshold_acc,
                               deterministic, *, block_verification: bool = False) -> None:
    """Fill ``predicts`` (flat, indexed by ``retrive_index``), ``accept_index`` [bs, slots]
    (entries 0..n) and ``accept_token_num`` [bs] (n) in place, as the Triton kernel does.

    ``candidates`` [bs, slots] (slot 0 the root), ``uniform_samples`` [bs, >= slots - 1],
    ``uniform_samples_for_final_sampling`` [bs], ``target_probs`` [bs, slots, V],
    ``draft_probs`` [bs, slots - 1, V]. Tree arguments and thresholds are unused (chain mode).
    Raises NotImplementedError for block verification.
    """
    if block_verification:
        raise NotImplementedError("CPU harness chain sampler: block verification is not ported")
    batch_size, slots = candidates.shape
    rows = torch.arange(batch_size, device=candidates.device)
    drafts = candidates[:, 1:].long()                                       # [bs, gamma]
    p = target_probs[:, :slots - 1].gather(2, drafts[..., None]).squeeze(-1)
    q = draft_probs[:, :slots - 1].gather(2, drafts[..., None]).squeeze(-1)
    accepted = (q > 0) & (q <= 1) & (uniform_samples[:, :slots - 1] * q < p)
    num_accept = accepted.long().cumprod(dim=1).sum(dim=1)                  # [bs] n
    positions = torch.arange(slots, device=candidates.device)
    kept = positions[None, :] <= num_accept[:, None]
    accept_index.copy_(torch.where(kept, retrive_index.to(accept_index.dtype), accept_index))
    accept_token_num.copy_(num_accept.to(accept_token_num.dtype))
    # Accepted draft s is the prediction of the node before it.
    draft_kept = kept[:, 1:]
    predicts[retrive_index[:, :-1][draft_kept].long()] = drafts[draft_kept].to(predicts.dtype)

    final_p = target_probs[rows, num_accept]
    final_q = draft_probs[rows, num_accept.clamp(max=slots - 2)]
    final_q = torch.where((final_q >= 0) & (final_q <= 1), final_q, 0.0)
    all_accepted = (num_accept == slots - 1)[:, None]
    weights = torch.where(all_accepted, final_p, (final_p - final_q).clamp(min=0))
    cdf = weights.cumsum(dim=1)
    target_u = uniform_samples_for_final_sampling * cdf[:, -1]
    above = cdf > target_u[:, None]
    # Kernel fallback for an all-zero residual: the last token.
    final = torch.where(above.any(dim=1), above.int().argmax(dim=1), weights.shape[1] - 1)
    last = retrive_index[rows, num_accept].long()
    predicts[last] = final.to(predicts.dtype)
