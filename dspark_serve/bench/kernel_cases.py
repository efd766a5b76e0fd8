"""Cases of the CUDA kernel benchmark (``dspark_serve.bench.kernels``, issue 7): random inputs,
the callables timed per case (our op, the PyTorch reference, FlashInfer peers when
importable), the correctness check on poisoned outputs, and the bytes that must move.

Markov sampling: R in {1, 32, 128}, gamma in {5, 7, 16}, V in {49152, 151936}, rank 256,
hidden 4096, bf16, each with greedy rows and with temperature 0.8 / top-p 0.95. Verify
attention: Hq 32 / Hkv 8 / D 128 (and one D 64 case), bf16, page size 16, T up to 4096
query tokens over contexts of 512-8192.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from dspark_serve.ops import markov_sample_reference, philox_uniforms, varlen_attention_reference
from dspark_serve.types import SamplingTensors

MARKOV_RANK, MARKOV_HIDDEN, PAGE_SIZE = 256, 4096, 16


@dataclass(frozen=True)
class MarkovCase:
    rows: int
    gamma: int
    vocab: int
    greedy: bool

    @property
    def name(self) -> str:
        mode = "greedy" if self.greedy else "T.8/p.95"
        return f"markov R={self.rows} g={self.gamma} V={self.vocab} {mode}"


@dataclass(frozen=True)
class AttentionCase:
    label: str
    requests: tuple[tuple[int, int], ...]  # (context length, query tokens) per request
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128

    @property
    def name(self) -> str:
        return f"attn {self.label} T={sum(n for _, n in self.requests)} D={self.head_dim}"


def markov_plan(quick: bool) -> list[MarkovCase]:
    rows, gammas, vocabs = ((1, 32), (7,), (49152,)) if quick else \
        ((1, 32, 128), (5, 7, 16), (49152, 151936))
    return [MarkovCase(r, g, v, greedy) for v in vocabs for r in rows for g in gammas
            for greedy in (True, False)]


def attention_plan(quick: bool) -> list[AttentionCase]:
    g = torch.Generator().manual_seed(0)
    ragged = tuple((int(c), int(n)) for c, n in zip(torch.randint(512, 8193, (128,), generator=g),
                                                    torch.randint(1, 17, (128,), generator=g)))
    cases = [AttentionCase("1x16@8192", ((8192, 16),)),
             AttentionCase("64x8@2048", ((2048, 8),) * 64),
             AttentionCase("32x8@8192", ((8192, 8),) * 32),
             AttentionCase("256x16@512", ((512, 16),) * 256),
             AttentionCase("128x32@4096", ((4096, 32),) * 128),
             AttentionCase("ragged128", ragged),
             AttentionCase("64x8@2048", ((2048, 8),) * 64, hq=16, hkv=4, head_dim=64)]
    return cases[:2] if quick else cases


def boundary_safe_uniforms(base_logits: torch.Tensor, hidden: torch.Tensor, w1: torch.Tensor,
                           w2: torch.Tensor, anchor: torch.Tensor, sampling: SamplingTensors,
                           uniforms: torch.Tensor, min_prob: float = 1e-3) -> torch.Tensor:
    """Uniforms [R, gamma] that put every inverse-CDF draw of ``markov_sample_reference`` in
    the middle of a token's interval: the drawn token if its probability is >= ``min_prob``,
    else the most likely token. Two correct samplers that sum the CDF in different orders
    (float32 rounding, ~1e-6) can pick neighbouring tokens when u lands on a boundary of a
    flat distribution; with these uniforms they cannot, so tests can demand identical tokens.
    Step k is fixed after the reference has run steps 1..k with the earlier fixed uniforms.
    """
    u = uniforms.clone()
    for k in range(u.shape[1]):
        probs = markov_sample_reference(base_logits[:, :k + 1], hidden[:, :k + 1], w1, w2, anchor,
                                        sampling, u[:, :k + 1]).probs[:, k].double()
        cdf = probs.cumsum(-1)
        tok = torch.searchsorted(cdf, u[:, k:k + 1].double() * cdf[:, -1:], right=True)
        tok = tok.clamp(max=probs.shape[1] - 1)
        tok = torch.where(probs.gather(1, tok) >= min_prob, tok, probs.argmax(-1, keepdim=True))
        high = cdf.gather(1, tok)
        u[:, k] = ((2 * high - probs.gather(1, tok)) / 2 / cdf[:, -1:]).squeeze(1).float()
    return u


def _nonzero_randn(*shape, dtype, generator, scale=1.0) -> torch.Tensor:
    x = torch.randn(*shape, device=generator.device, generator=generator) * scale
    return torch.where(x == 0, 1e-3, x).to(dtype)


@dataclass
class Prepared:
    """Callables and facts of one case: ``ours``/``reference``/``peers`` run it once;
    ``check`` returns (ok, detail) from poisoned outputs; ``bytes`` is the traffic floor."""

    ours: Callable[[], object]
    reference: Callable[[], object]
    peers: dict[str, Callable[[], object]]
    check: Callable[[], tuple[bool, str]]
    bytes: int


def prepare_markov(case: MarkovCase, flashinfer, device: str = "cuda") -> Prepared:
    """Inputs and callables of a Markov sampling case (``flashinfer``: the module or None)."""
    dt, r, g, v = torch.bfloat16, case.rows, case.gamma, case.vocab
    gen = torch.Generator(device=device).manual_seed(case.rows * 1000 + case.gamma)
    # Peaked like an LLM's logits (top token ~0.1-0.5), not a flat random distribution.
    base = _nonzero_randn(r, g, v, dtype=dt, scale=4.0, generator=gen)
    hidden = _nonzero_randn(r, g, MARKOV_HIDDEN, dtype=dt, generator=gen)
    w1 = _nonzero_randn(v, MARKOV_RANK, dtype=dt, generator=gen)
    w2 = _nonzero_randn(v, MARKOV_RANK, dtype=dt, scale=0.1, generator=gen)
    cw = _nonzero_randn(MARKOV_HIDDEN + MARKOV_RANK, dtype=dt, scale=0.02, generator=gen)
    cb = _nonzero_randn(1, dtype=dt, generator=gen)
    anchor = torch.randint(0, v, (r,), device=device, generator=gen)
    sampling = SamplingTensors.uniform(r, 0.0 if case.greedy else 0.8, 0,
                                       1.0 if case.greedy else 0.95, device=device)
    u = philox_uniforms(torch.arange(r, device=device),
                        torch.zeros(r, dtype=torch.int64, device=device), g)
    outs = (torch.empty(r, g, dtype=torch.int64, device=device),
            torch.empty(r, g, v, device=device), torch.empty(r, g, device=device))
    s = sampling

    def ours():
        torch.ops.dspark.markov_sample(base, hidden, w1, w2, cw, cb, anchor, s.temperature, s.top_k,
                                       s.top_p, s.min_p, u, *outs, 0)

    def reference():
        return markov_sample_reference(base, hidden, w1, w2, anchor, sampling, u, cw, cb)

    def check():
        u.copy_(boundary_safe_uniforms(base, hidden, w1, w2, anchor, sampling, u))
        outs[0].fill_(-7)
        outs[1].fill_(float("nan"))
        outs[2].fill_(float("nan"))
        ours()
        ref = reference()
        same = (outs[0] == ref.tokens).float().mean().item()
        rel = ((outs[1] - ref.probs).abs() / ref.probs.abs().clamp_min(1e-6)).max().item()
        nan = bool(outs[1].isnan().any() | outs[2].isnan().any())
        return same == 1.0 and rel < 1e-3 and not nan, f"tokens {same:.4f} same, max rel {rel:.1e}"

    peers = {}
    if flashinfer is not None and not case.greedy:
        w2f = w2.float()

        def flashinfer_loop():
            prev = anchor
            for k in range(g):
                logits = base[:, k].float() + w1[prev].float() @ w2f.T
                probs = torch.softmax(logits / 0.8, dim=-1)
                prev = flashinfer.sampling.top_p_sampling_from_probs(probs, 0.95)
        peers["flashinfer top-p loop"] = flashinfer_loop
        draft_probs = torch.softmax(base.float(), dim=-1)
        target_probs = torch.softmax(torch.cat([base, base[:, :1]], dim=1).float() * 1.1, dim=-1)
        draft_ids = torch.randint(0, v, (r, g), device=device, generator=gen, dtype=torch.int32)
        chain = flashinfer.sampling.chain_speculative_sampling
        peers["flashinfer chain_spec (verify)"] = \
            lambda: chain(draft_probs, draft_ids, target_probs)
    size = base.element_size()
    traffic = (r * g * v * size + r * g * v * 4 + g * math.ceil(r / 128) * v * MARKOV_RANK * size
               + r * g * MARKOV_HIDDEN * size)
    return Prepared(ours, reference, peers, check, traffic)


def prepare_attention(case: AttentionCase, flashinfer, device: str = "cuda") -> Prepared:
    """Inputs and callables of a verify attention case (tokens grouped by request)."""
    dt, d = torch.bfloat16, case.head_dim
    gen = torch.Generator(device=device).manual_seed(len(case.requests))
    pages_per = [math.ceil(c / PAGE_SIZE) for c, _ in case.requests]
    num_pages = sum(pages_per)
    k_cache = _nonzero_randn(num_pages, PAGE_SIZE, case.hkv, d, dtype=dt, generator=gen)
    v_cache = _nonzero_randn(num_pages, PAGE_SIZE, case.hkv, d, dtype=dt, generator=gen)
    perm = torch.randperm(num_pages, device=device, generator=gen).to(torch.int32)
    page_table = torch.zeros(len(case.requests), max(pages_per), dtype=torch.int32, device=device)
    markers, start = [], 0
    for slot, ((ctx, n_q), n_pages) in enumerate(zip(case.requests, pages_per)):
        page_table[slot, :n_pages] = perm[start:start + n_pages]
        start += n_pages
        markers += [(slot, p) for p in range(ctx - n_q, ctx)]
    marker = torch.tensor(markers, dtype=torch.int32, device=device)
    t = marker.shape[0]
    q = _nonzero_randn(t, case.hq, d, dtype=dt, generator=gen)
    out = torch.empty_like(q)
    scale = d ** -0.5

    def ours():
        torch.ops.dspark.varlen_attention(q, marker, k_cache, v_cache, page_table, out, scale, 0)

    def reference():
        return varlen_attention_reference(q, marker, k_cache, v_cache, page_table)

    def check():
        out.fill_(float("nan"))
        ours()
        ref = varlen_attention_reference(q.float(), marker, k_cache.float(), v_cache.float(),
                                         page_table)
        err = (out.float() - ref).abs().max().item()
        return err < 2e-2 and not bool(out.isnan().any()), f"max abs err {err:.1e}"

    peers = {}
    if flashinfer is not None:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device), "NHD")
        n_q = torch.tensor([n for _, n in case.requests], device=device)
        ctx = torch.tensor([c for c, _ in case.requests], device=device)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        qo_indptr = torch.cat([zero, n_q.cumsum(0).int()])
        kv_indptr = torch.cat([zero, torch.tensor(pages_per, device=device).cumsum(0).int()])
        kv_indices = torch.cat([page_table[i, :n] for i, n in enumerate(pages_per)])
        last_len = ((ctx - 1) % PAGE_SIZE + 1).int()
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_len, case.hq, case.hkv, d, PAGE_SIZE,
                     causal=True, q_data_type=dt, kv_data_type=dt)
        peers["flashinfer paged prefill"] = lambda: wrapper.run(q, (k_cache, v_cache))
    size = q.element_size()
    traffic = 2 * q.numel() * size + sum(c for c, _ in case.requests) * case.hkv * d * 2 * size
    return Prepared(ours, reference, peers, check, traffic)
