"""Fused Markov block sampling (paper Eq 4, 5, 7): the CUDA kernel ``dspark::markov_sample``
and its PyTorch reference.

For k = 1..gamma, with x_0 the anchor and u the caller's uniforms:
    logits_k = U_k + W1[x_{k-1}] W2^T            (Eq 5; bias accumulated in float32)
    p_k      = warp_probs(logits_k, sampling)     (temperature, top-k, top-p, min-p)
    x_k      = sample_from_probs(p_k, u[:, k-1])  (inverse CDF)
    conf_k   = w . [h_k ; W1[x_{k-1}]] + b        (Eq 7, raw logit)
The left-to-right draw itself is ``sequential_sample``, shared with the drafter
(``dspark_serve.drafter.block_sampler.sample_block``, the CPU engine's path, which calls it
with its own head's step and dispatches a plain Markov head on a GPU to the kernel). The
reference keeps the bias and the confidence logit in float32, as the kernel does; the
drafter's modules round them to the weights' dtype. The kernel runs all gamma steps in one
launch (``csrc/markov_sample.cuh``); given the same uniforms it picks the same tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from dspark_serve.ops.extension import capturing, use_cuda_kernel
from dspark_serve.sampling.argmax import row_argmax
from dspark_serve.sampling.sampler import sample_from_probs
from dspark_serve.sampling.warping import GREEDY_TEMPERATURE, warp_probs
from dspark_serve.types import DraftBlock, SamplingTensors

# launch_mode values of the CUDA op.
LAUNCH_AUTO, LAUNCH_PERSISTENT, LAUNCH_PER_PHASE = 0, 1, 2
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def markov_sample(base_logits: torch.Tensor, hidden: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, anchor: torch.Tensor, sampling: SamplingTensors,
                  uniforms: torch.Tensor, conf_weight: torch.Tensor | None = None,
                  conf_bias: torch.Tensor | None = None, *, launch_mode: int = LAUNCH_AUTO,
                  validate: bool = True) -> DraftBlock:
    """Draw a block of gamma draft tokens per request with the Markov head.

    Uses the CUDA kernel when every tensor is on a GPU, the extension is built, the
    floating tensors share one dtype (fp32/fp16/bf16) and the rank is a positive multiple of 16;
    otherwise ``markov_sample_reference``.

    Args:
        base_logits: [R, gamma, V] float, the backbone's base logits U.
        hidden: [R, gamma, d] float, backbone hidden states h (d may be 0 without a
            confidence head).
        w1: [V, r] Markov embedding table (``markov_w1.weight``).
        w2: [V, r] Markov projection (``markov_w2.weight``, an nn.Linear r -> V).
        anchor: [R] int64, x_0.
        sampling: ``SamplingTensors`` with R rows.
        uniforms: [R, gamma] float32 in [0, 1); step k uses column k-1 (for example from
            ``dspark_serve.ops.philox.philox_uniforms``).
        conf_weight: [d + r] confidence weight (``confidence_head.proj.weight.view(-1)``)
            or None; conf_bias: [1] with it.
        launch_mode: CUDA only: 0 auto, 1 one persistent cooperative launch, 2 one launch
            per phase (2 * gamma + 1 launches).
        validate: check values (anchor range, sampling parameters, uniforms); this costs a
            host sync and is skipped during CUDA graph capture.

    Returns:
        ``DraftBlock``: tokens [R, gamma] int64, probs [R, gamma, V] float32 (warped p_d),
        conf_logits [R, gamma] float32 (zeros without a confidence head).

    Raises:
        ValueError: inconsistent shapes, dtypes or devices, or (validate) bad values.
    """
    r, gamma, vocab, rank = _check_shapes(base_logits, hidden, w1, w2, anchor, uniforms,
                                          conf_weight, conf_bias)
    if validate and not capturing():
        _check_values(anchor, uniforms, vocab)
    floats = [base_logits, hidden, w1, w2]
    if conf_weight is not None:
        floats += [conf_weight, conf_bias]
    tensors = floats + [anchor, uniforms, sampling.temperature, sampling.top_k, sampling.top_p,
                        sampling.min_p]
    kernel_ok = (use_cuda_kernel(*tensors) and rank > 0 and rank % 16 == 0
                 and w1.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
                 and base_logits.dtype in _KERNEL_DTYPES
                 and all(t.dtype == base_logits.dtype for t in floats))
    if not kernel_ok:
        return markov_sample_reference(base_logits, hidden, w1, w2, anchor, sampling, uniforms,
                                       conf_weight, conf_bias)
    if validate and not capturing():
        # warp_probs validates the sampling parameters; a [R, 1] call costs nothing.
        warp_probs(torch.zeros((r, 1), device=base_logits.device), sampling)
    device = base_logits.device
    tokens = torch.empty((r, gamma), dtype=torch.int64, device=device)
    probs = torch.empty((r, gamma, vocab), dtype=torch.float32, device=device)
    conf = torch.empty((r, gamma), dtype=torch.float32, device=device)
    if r and gamma:
        torch.ops.dspark.markov_sample(
            base_logits.contiguous(), hidden.contiguous(), w1.contiguous(), w2.contiguous(),
            None if conf_weight is None else conf_weight.contiguous(),
            None if conf_bias is None else conf_bias.contiguous(), anchor.contiguous(),
            sampling.temperature.contiguous(), sampling.top_k.contiguous(),
            sampling.top_p.contiguous(), sampling.min_p.contiguous(), uniforms.contiguous(),
            tokens, probs, conf, launch_mode)
    return DraftBlock(tokens=tokens, probs=probs, conf_logits=conf)


def markov_sample_reference(base_logits: torch.Tensor, hidden: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, anchor: torch.Tensor, sampling: SamplingTensors,
                            uniforms: torch.Tensor, conf_weight: torch.Tensor | None = None,
                            conf_bias: torch.Tensor | None = None) -> DraftBlock:
    """PyTorch reference of ``markov_sample`` (same arguments, no launch options):
    ``sequential_sample`` with the Eq 5 bias in float32, then the Eq 7 logits."""
    r, gamma, _, rank = _check_shapes(base_logits, hidden, w1, w2, anchor, uniforms,
                                      conf_weight, conf_bias)
    w2f = w2.float()
    embeddings = []                                     # W1[x_{k-1}] [R, r] per position

    def markov_bias(k: int, prev: torch.Tensor) -> torch.Tensor:
        embeddings.append(w1[prev].float())
        return embeddings[-1] @ w2f.T

    tokens, probs = sequential_sample(base_logits, anchor, markov_bias, sampling, uniforms)
    conf = torch.zeros((r, gamma), dtype=torch.float32, device=base_logits.device)
    if conf_weight is not None and gamma:
        d, cw = hidden.shape[2], conf_weight.float()
        conf = hidden.float() @ cw[:d] + torch.stack(embeddings, dim=1) @ cw[d:] \
            + conf_bias.float()
    return DraftBlock(tokens=tokens, probs=probs, conf_logits=conf)


def sequential_sample(base_logits: torch.Tensor, anchor: torch.Tensor,
                      bias_step: Callable[[int, torch.Tensor], torch.Tensor] | None,
                      sampling: SamplingTensors,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The left-to-right draw of Eq 4: x_k ~ warp(U_k + bias_step(k - 1, x_{k-1})).

    Args:
        base_logits: [R, gamma, V] float, U.
        anchor: [R] int64, x_0.
        bias_step: (k, x_k [R] int64) -> [R, V] bias of position k + 1, called for
            k = 0..gamma-1 in order (a recurrent head keeps its state in the closure); None =
            no sequential head (DFlash: independent positions, warped and sampled at once).
        sampling: ``SamplingTensors`` with R rows.
        uniforms: [R, gamma] float32 in [0, 1); position k uses column k-1.
    Returns:
        tokens [R, gamma] int64 and probs [R, gamma, V] float32, the warped p_d each token was
        drawn from (a one-hot at the argmax for temperature 0).
    """
    r, gamma, vocab = base_logits.shape
    # All-greedy rounds: warp_probs would make each position a one-hot at the first argmax
    # and sampling it returns that argmax, so take the argmax and build the one-hots once
    # (saves a [R, V] warp and cumulative sum per position: ~10 ms of a CPU step at R = 4).
    greedy = bool((sampling.temperature < GREEDY_TEMPERATURE).all())
    if bias_step is None:
        logits = base_logits.float()
        if greedy:
            tokens = row_argmax(logits)
        else:
            probs = warp_probs(logits.reshape(r * gamma, vocab),
                               sampling.repeat_interleave(gamma)).view(r, gamma, vocab)
            tokens = sample_from_probs(probs.view(r * gamma, vocab),
                                       uniforms.reshape(-1)).view(r, gamma)
    else:
        prev = anchor
        token_list, prob_list = [], []
        for k in range(gamma):
            logits_k = base_logits[:, k].float() + bias_step(k, prev).float()
            if greedy:
                prev = row_argmax(logits_k)
            else:
                prob_list.append(warp_probs(logits_k, sampling))
                prev = sample_from_probs(prob_list[-1], uniforms[:, k].contiguous())
            token_list.append(prev)
        tokens = torch.stack(token_list, dim=1) if gamma else anchor.new_empty((r, 0))
        if not greedy:
            probs = torch.stack(prob_list, dim=1) if gamma else base_logits.new_empty(
                (r, 0, vocab), dtype=torch.float32)
    if greedy:
        probs = torch.zeros(r, gamma, vocab, dtype=torch.float32, device=tokens.device)
        probs.scatter_(2, tokens[:, :, None], 1.0)
    return tokens, probs


def _check_shapes(base_logits, hidden, w1, w2, anchor, uniforms, conf_weight,
                  conf_bias) -> tuple[int, int, int, int]:
    if base_logits.dim() != 3 or not base_logits.is_floating_point():
        raise ValueError(f"base_logits must be floating [R, gamma, V], got {base_logits.dtype} "
                         f"{tuple(base_logits.shape)}")
    r, gamma, vocab = base_logits.shape
    if w1.dim() != 2 or w1.shape[0] != vocab or w2.shape != w1.shape:
        raise ValueError(f"w1 and w2 must both be [V={vocab}, r], got {tuple(w1.shape)} and "
                         f"{tuple(w2.shape)}")
    rank = w1.shape[1]
    if hidden.dim() != 3 or hidden.shape[:2] != (r, gamma) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating [{r}, {gamma}, d], got {tuple(hidden.shape)}")
    if anchor.shape != (r,) or anchor.dtype != torch.int64:
        raise ValueError(f"anchor must be int64 [{r}], got {anchor.dtype} {tuple(anchor.shape)}")
    if uniforms.shape != (r, gamma) or uniforms.dtype != torch.float32:
        raise ValueError(f"uniforms must be float32 [{r}, {gamma}], got {uniforms.dtype} "
                         f"{tuple(uniforms.shape)}")
    if (conf_weight is None) != (conf_bias is None):
        raise ValueError("conf_weight and conf_bias must be given together")
    if conf_weight is not None:
        d = hidden.shape[2]
        if conf_weight.shape != (d + rank,) or conf_bias.shape != (1,):
            raise ValueError(f"conf_weight must be [d + r = {d + rank}] and conf_bias [1], got "
                             f"{tuple(conf_weight.shape)} and {tuple(conf_bias.shape)}")
    devices = {t.device for t in (base_logits, hidden, w1, w2, anchor, uniforms)}
    if conf_weight is not None:
        devices |= {conf_weight.device, conf_bias.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return r, gamma, vocab, rank


def _check_values(anchor: torch.Tensor, uniforms: torch.Tensor, vocab: int) -> None:
    bad = torch.stack([((anchor < 0) | (anchor >= vocab)).any(),
                       ((uniforms < 0) | (uniforms >= 1) | uniforms.isnan()).any()]).tolist()
    if bad[0]:
        raise ValueError(f"anchor ids must be in [0, {vocab})")
    if bad[1]:
        raise ValueError("uniforms must be in [0, 1)")
