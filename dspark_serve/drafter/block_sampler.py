"""Sequential stage of semi-autoregressive drafting (paper Eq 4) and its teacher-forced twin.

p_k(. | x_0, x_<k) = warp(U_k + B_k(x_0, x_<k, .)) for k = 1..gamma, sampled left to right;
U_k are the backbone's base logits, B_k the sequential head's bias (none: the DFlash
ablation, where every position is independent), x_0 the anchor. The warping (temperature,
top-k, top-p, min-p) is ``dspark_serve.sampling.warping.warp_probs``, the same function the
verifier applies to the target, so rejection sampling compares like with like. The bias is
added in float32 (DeepSpec adds it in the model dtype; float32 keeps bf16 drafters from
rounding the sum). The draw is ``dspark_serve.ops.markov.sequential_sample``, also the fused
CUDA kernel's reference; a plain Markov head on a GPU runs that kernel when it is built. On a
CPU with the quantized-linear kernel (an int4 target's drafter, ``MarkovHead.compile_draw``) a
plain Markov head draws rows that warp by temperature alone in one compiled call
(``markov_draw``); an all-greedy round then returns probs None (one-hot at the tokens).

The teacher-forced path evaluates the same per-position computation for given tokens, so its
logits equal the PyTorch sampling path's bit for bit when fed the sampled tokens (the kernel
keeps the bias in float32 where the head's modules round it to their dtype).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_serve.drafter.confidence_head import ConfidenceHead
from dspark_serve.drafter.draft_vocab import scatter_to_vocab
from dspark_serve.drafter.markov_head import MarkovHead
from dspark_serve.ops.extension import use_cuda_kernel
from dspark_serve.ops.markov import markov_sample, sequential_sample
from dspark_serve.sampling.warping import GREEDY_TEMPERATURE
from dspark_serve.types import DraftBlock, SamplingTensors


def sample_block(base_logits: torch.Tensor, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                 head: nn.Module | None, confidence_head: ConfidenceHead | None,
                 sampling: SamplingTensors, uniforms: torch.Tensor, *,
                 draft_vocab: torch.Tensor | None = None,
                 vocab_size: int | None = None) -> DraftBlock:
    """Draw x_1..x_gamma for R blocks (Eq 4) and their confidence logits (Eq 7).

    Args:
        base_logits: [R, gamma, V_d] float, U_k over the draft vocabulary.
        hidden: [R, gamma, d] backbone hidden states h_k.
        anchor_tokens: [R] int64, x_0.
        head: sequential head (``MarkovHead``/``GatedMarkovHead``/``RNNHead``) or None.
        confidence_head: ``ConfidenceHead`` or None (then conf_logits are zeros).
        sampling: ``SamplingTensors`` with R rows.
        uniforms: [R, gamma] float32 in [0, 1); position k uses column k-1.
        draft_vocab: [V_d] int64 target ids of a pruned draft vocabulary (None: V_d = V);
            vocab_size: V, required with it.
    Returns:
        ``DraftBlock`` (tokens [R, gamma] int64 target ids, probs [R, gamma, V] float32 = the
        warped p_d each token was drawn from, 0 outside the draft vocabulary, conf_logits
        [R, gamma] float32).
    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    r, gamma, _ = _check(base_logits, hidden, anchor_tokens)
    if uniforms.shape != (r, gamma) or uniforms.dtype != torch.float32:
        raise ValueError(f"uniforms must be float32 [{r}, {gamma}], got {uniforms.dtype} "
                         f"{tuple(uniforms.shape)}")
    if draft_vocab is not None and (vocab_size is None
                                    or draft_vocab.shape != (base_logits.shape[2],)):
        raise ValueError(f"draft_vocab must be [{base_logits.shape[2]}] (the logits' width) "
                         f"and needs vocab_size")
    if (draft_vocab is None and type(head) is MarkovHead and use_cuda_kernel(base_logits)
            and (confidence_head is None or confidence_head.markov_rank == head.rank)):
        conf = () if confidence_head is None else (confidence_head.proj.weight.view(-1),
                                                   confidence_head.proj.bias)
        return markov_sample(base_logits, hidden, head.markov_w1.weight,
                             head.markov_w2.weight, anchor_tokens, sampling, uniforms, *conf)
    if isinstance(head, MarkovHead) and head.compiled and _unfiltered(sampling, base_logits):
        # greedy rounds leave probs None: one-hot at the tokens, built only if needed
        greedy = bool((sampling.temperature < GREEDY_TEMPERATURE).all())
        tokens, probs = head.draw(base_logits, anchor_tokens, sampling.temperature, uniforms,
                                  draft_vocab, GREEDY_TEMPERATURE, want_probs=not greedy)
        if probs is not None and draft_vocab is not None:
            probs = scatter_to_vocab(probs, draft_vocab, vocab_size)
        conf = confidence_logits(hidden, _prev_tokens(anchor_tokens, tokens), head,
                                 confidence_head)
        return DraftBlock(tokens=tokens, probs=probs, conf_logits=conf)
    bias_step = None
    if head is not None:
        state = head.init_state((r,), hidden)

        def bias_step(k: int, prev: torch.Tensor) -> torch.Tensor:
            nonlocal state
            # the head conditions on target ids: x_0 is one, later draws index draft_vocab
            if k and draft_vocab is not None:
                prev = draft_vocab[prev]
            state, bias = head.step(state, prev, hidden[:, k])
            return bias

    tokens, probs = sequential_sample(base_logits, anchor_tokens, bias_step, sampling, uniforms)
    if draft_vocab is not None:
        tokens, probs = draft_vocab[tokens], scatter_to_vocab(probs, draft_vocab, vocab_size)
    conf = confidence_logits(hidden, _prev_tokens(anchor_tokens, tokens), head, confidence_head)
    return DraftBlock(tokens=tokens, probs=probs, conf_logits=conf)


def _unfiltered(sampling: SamplingTensors, base_logits: torch.Tensor) -> bool:
    """Whether the compiled draw applies: bfloat16 CPU logits and rows that warp by temperature
    alone (top-k off or >= V_d, top-p 1, min-p 0)."""
    vocab = base_logits.shape[2]
    return (base_logits.dtype == torch.bfloat16 and not base_logits.is_cuda
            and bool((((sampling.top_k == 0) | (sampling.top_k >= vocab))
                      & (sampling.top_p >= 1.0) & (sampling.min_p <= 0.0)).all()))


def teacher_forced(base_logits: torch.Tensor, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                   tokens: torch.Tensor, head: nn.Module | None,
                   confidence_head: ConfidenceHead | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq 4 logits and Eq 7 confidence logits of all gamma positions for given tokens.

    Args:
        base_logits, hidden, anchor_tokens, head, confidence_head: as ``sample_block``.
        tokens: [R, gamma] int64, x_1..x_gamma (x_k conditions positions > k only).
    Returns:
        logits [R, gamma, V_d] float32 (U_k + B_k, unwarped, over the draft vocabulary),
        conf_logits [R, gamma] float32.
    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    r, gamma, _ = _check(base_logits, hidden, anchor_tokens)
    if tokens.shape != (r, gamma) or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [{r}, {gamma}], got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    prev = _prev_tokens(anchor_tokens, tokens)
    if head is None:
        logits = base_logits.float()
    else:
        state = head.init_state((r,), hidden)
        steps = []
        for k in range(gamma):
            state, bias = head.step(state, prev[:, k], hidden[:, k])
            steps.append(base_logits[:, k].float() + bias.float())
        logits = torch.stack(steps, dim=1)
    return logits, confidence_logits(hidden, prev, head, confidence_head)


def confidence_logits(hidden: torch.Tensor, prev_tokens: torch.Tensor, head: nn.Module | None,
                      confidence_head: ConfidenceHead | None) -> torch.Tensor:
    """Eq 7 logits [R, gamma] float32 from hidden [R, gamma, d] and x_{k-1} [R, gamma];
    zeros without a confidence head."""
    if confidence_head is None:
        return torch.zeros(prev_tokens.shape, dtype=torch.float32, device=hidden.device)
    markov = None
    if confidence_head.markov_rank > 0:
        if head is None:
            raise ValueError("the confidence head uses the Markov embedding but there is no head")
        markov = head.prev_embedding(prev_tokens)
    return confidence_head(hidden, markov)


def _prev_tokens(anchor_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """x_{k-1} for k = 1..gamma: [anchor, x_1, ..., x_{gamma-1}]."""
    return torch.cat([anchor_tokens[:, None], tokens[:, :-1]], dim=1)


def _check(base_logits: torch.Tensor, hidden: torch.Tensor,
           anchor_tokens: torch.Tensor) -> tuple[int, int, int]:
    if base_logits.dim() != 3 or not base_logits.is_floating_point():
        raise ValueError(f"base_logits must be floating [R, gamma, V], got "
                         f"{base_logits.dtype} {tuple(base_logits.shape)}")
    r, gamma, vocab = base_logits.shape
    if hidden.dim() != 3 or hidden.shape[:2] != (r, gamma):
        raise ValueError(f"hidden must be [{r}, {gamma}, d], got {tuple(hidden.shape)}")
    if anchor_tokens.shape != (r,) or anchor_tokens.dtype != torch.int64:
        raise ValueError(f"anchor_tokens must be int64 [{r}], got {anchor_tokens.dtype} "
                         f"{tuple(anchor_tokens.shape)}")
    return r, gamma, vocab
