"""``dspark-serve bench draft``: what one drafting round costs, phase by phase, next to the
target decode step it rides on (issue 16's budget: a draft <= 15 % of that step).

For R requests (``--requests``), each holding ``--context`` cached context positions, the
shipped drafter and target are loaded as the engine serves them (``build_engine``: same
quantization, pruned draft vocabulary, 4-bit drafter linears under an int4 target) and timed:

- draft: ``DSparkDrafter.draft`` for the R blocks (greedy rows, as in the benchmarks), of
  ``--widths`` draft positions (default gamma; the async scheduler drafts K + 1 of them),
  split into the backbone (block embeddings and draft layers over the cached context), the LM
  head over the draft vocabulary, and the sequential head's left-to-right draw plus the
  confidence head (``sample_block``; the dense [R, gamma, V] draft probabilities included);
- context per token: projecting one committed token's target taps into the drafter's context
  (``extend_context``; a step pays it once per committed token, a drafter that starts on a
  long prompt pays it for the whole prompt once);
- target step: one decode forward over the R requests' next tokens (``bench step``'s layout).

Context taps are random (the times do not depend on their values). Every repeat calls each
phase once, one after another, so a slow moment of a shared host lands on all of them; each
figure is the median over ``--repeats`` (differences and the share taken per repeat).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark_serve.bench.step_profile import _int_list, _load_text, filled_cache, step_inputs
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.engine.config import QUANTIZATIONS
from dspark_serve.model.target_model import TargetModel
from dspark_serve.types import SamplingTensors

DEFAULT_REQUESTS = (1, 4, 16)
# A draft's share of the target decode step that issue 16 asks for at concurrency 1.
DRAFT_BUDGET = 0.15


def _interleaved_ms(fns: list, repeats: int) -> list[list[float]]:
    """Wall milliseconds of each of ``fns`` per repeat, called one after another in every
    repeat (a slow moment of a shared host lands on all of them), after one warm-up round."""
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            if i:
                out.append(1e3 * (time.perf_counter() - start))
    return times


def draft_times(target: TargetModel, drafter: DSparkDrafter, requests: int, *, context: int,
                width: int | None = None, repeats: int = 15, seed: int = 0) -> dict:
    """Phase times of one drafting round for ``requests`` requests at ``context`` cached
    positions each, blocks of ``width`` draft positions (None: gamma; module docstring).

    Returns:
        {"R", "width", "draft_ms", "backbone_ms", "lm_head_ms", "sampling_ms",
        "context_us_per_token", "step_ms", "share"}: milliseconds (wall, median over repeats;
        backbone = block forward - LM head and sampling = draft - block forward, per repeat),
        microseconds per context token, and share = the median over repeats of draft / step
        time.
    Raises:
        ValueError: requests or context < 1, width outside 1..gamma.
    """
    if requests < 1 or context < 1:
        raise ValueError(f"requests and context must be >= 1, got {requests}, {context}")
    width = drafter.gamma if width is None else width
    if not 1 <= width <= drafter.gamma:
        raise ValueError(f"width must be in 1..{drafter.gamma}, got {width}")
    gen = torch.Generator().manual_seed(seed)
    device = target.device
    cache = drafter.new_cache(requests, context + drafter.gamma + 1)
    slots = torch.arange(requests, device=device)
    flat_slots = slots.repeat_interleave(context)
    positions = torch.arange(context, device=device).repeat(requests)
    taps = torch.randn(requests * context, drafter.config.context_dim, generator=gen)
    drafter.extend_context(cache, flat_slots, positions, taps.to(device))
    # one committed token per request, rewritten in place at the last context position
    last = torch.full((requests,), context - 1, device=device)
    one_token = taps[:requests].to(device)
    anchors = torch.randint(0, drafter.config.vocab_size, (requests,), generator=gen).to(device)
    anchor_pos = torch.full((requests,), context, device=device)
    sampling = SamplingTensors.uniform(requests, temperature=0.0, device=device)
    uniforms = torch.rand(requests, width, generator=gen).to(device)
    hidden, _ = drafter.block_forward(cache, slots, anchors, anchor_pos, width)
    _, lm_head = drafter.shared_modules
    weight = getattr(lm_head, "weight", None)
    head_in = hidden if weight is None else hidden.to(weight.dtype)
    step_ids, step_slots, step_pos = step_inputs(requests, 1, context, target.weights.vocab_size)
    step_cache = filled_cache(target, requests, context + 1)
    draft, block, head, extend, step = _interleaved_ms([
        lambda: drafter.draft(cache, slots, anchors, anchor_pos, sampling, uniforms),
        lambda: drafter.block_forward(cache, slots, anchors, anchor_pos, width),
        lambda: lm_head(head_in),
        lambda: drafter.extend_context(cache, slots, last, one_token),
        lambda: target.forward(step_ids, step_slots, step_pos, step_cache)], repeats)
    med = statistics.median
    return {"R": requests, "width": width, "draft_ms": med(draft),
            "backbone_ms": med(b - h for b, h in zip(block, head)), "lm_head_ms": med(head),
            "sampling_ms": med(d - b for d, b in zip(draft, block)),
            "context_us_per_token": 1e3 * med(extend) / requests, "step_ms": med(step),
            "share": med(d / s for d, s in zip(draft, step))}


def format_draft_table(records: list[dict]) -> str:
    """One row per R and width: the phase times (ms), the context cost per token (us), the
    target decode step (ms) and the draft's share of it, against ``DRAFT_BUDGET``."""
    lines = [f"{'R':>3} {'width':>5} {'draft ms':>9} {'backbone':>9} {'LM head':>8} "
             f"{'sampling':>9} {'ctx us/tok':>10} {'step ms':>8} {'draft/step':>10}"]
    for r in records:
        verdict = "ok" if r["share"] <= DRAFT_BUDGET else "over"
        lines.append(f"{r['R']:>3} {r['width']:>5} {r['draft_ms']:>9.2f} "
                     f"{r['backbone_ms']:>9.2f} {r['lm_head_ms']:>8.2f} {r['sampling_ms']:>9.2f} "
                     f"{r['context_us_per_token']:>10.1f} {r['step_ms']:>8.2f} "
                     f"{100 * r['share']:>8.0f} % {verdict}")
    lines.append(f"(budget: a draft <= {100 * DRAFT_BUDGET:.0f} % of the target decode step)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from dspark_serve.engine.builder import build_engine
    from dspark_serve.engine.config import EngineConfig

    torch.set_num_threads(args.threads)
    parts = build_engine(EngineConfig(
        model=args.model, draft=args.draft, speculative="dspark", scheduler="static",
        quantization=args.quantization, max_num_seqs=max(args.requests),
        max_model_len=args.context + 64))
    drafter = parts.speculator.drafter
    vocab = drafter.draft_vocab
    print(f"drafter {args.draft or 'shipped'} ({drafter.config.num_hidden_layers} layers, draft "
          f"vocabulary {drafter.config.vocab_size if vocab is None else vocab.numel()}, gamma "
          f"{drafter.gamma}); target quantization={args.quantization} threads={args.threads} "
          f"context={args.context}; " + _load_text())
    records = [draft_times(parts.target, drafter, r, context=args.context, width=w,
                           repeats=args.repeats)
               for r in args.requests for w in args.widths or [drafter.gamma]]
    print(format_draft_table(records))
    print(_load_text())
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``draft`` on the ``bench`` subparsers."""
    p = subparsers.add_parser("draft", help="one drafting round by phase vs a target step",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="drafter folder (default: the shipped one)")
    p.add_argument("--quantization", default="int4", choices=QUANTIZATIONS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=_int_list, default=list(DEFAULT_REQUESTS))
    p.add_argument("--widths", type=_int_list, default=None,
                   help="draft positions per block, e.g. 7,3 (default: gamma; the async "
                        "scheduler drafts K + 1, often 2-4 at one user)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.set_defaults(func=main)
