"""The oracle drafter and the engine recorder of the reliability tests (loaded by
``conftest.py``; see its docstring for how they are used)."""
from __future__ import annotations

import math

import torch

from dspark_serve.engine.outputs import RequestFailed
from dspark_serve.types import DraftBlock

KNOWN_LOGIT = 8.0     # confidence logit of a position the oracle knows (survival ~1)
UNKNOWN_LOGIT = -8.0  # ... of the real drafter's guesses (almost never verified)


def allowed_count(ranked: list[tuple[int, float]], top_k: int, top_p: float, min_p: float,
                  tol: float = 1e-4) -> int | None:
    """How many of the most probable tokens survive top-k / top-p / min-p warping at
    temperature 1 (each filter on the raw distribution; use one filter at a time).

    Args:
        ranked: (token id, raw target logprob) pairs, most probable first (a top-N list).
        tol: probability slack in favour of keeping a token near a cut-off (the reference and
            the engine under test compute the logits in different batch shapes).
    Returns:
        the count, or None when the nucleus reaches past the end of ``ranked``.
    """
    probs = [math.exp(lp) for _, lp in ranked]
    n = len(probs)
    if top_k:
        n = min(n, sum(p >= probs[min(top_k, len(probs)) - 1] - tol for p in probs))
    if top_p < 1.0:
        cum, keep = 0.0, 0
        while keep < len(probs) and cum < top_p + tol:
            cum += probs[keep]
            keep += 1
        if cum < top_p - tol and keep == len(probs):
            return None
        # warp_probs keeps every token tied with the last one in the nucleus (bfloat16
        # logits tie often: measured, two tokens at exactly 0.37353 under top_p 0.3)
        n = min(n, sum(p >= probs[keep - 1] - tol for p in probs))
    if min_p:
        n = min(n, sum(p >= min_p * probs[0] - tol for p in probs))
    return n


class OracleDrafter:
    """The engine's drafter with its blocks overwritten by recorded target continuations.

    Modes (``mode``):
        "greedy": propose the recorded greedy continuation (up to gamma tokens), one-hot
            draft probabilities, confidence ``KNOWN_LOGIT``; unknown positions keep the real
            drafter's tokens with ``UNKNOWN_LOGIT``.
        "mixed": as greedy, but keep only the first ``(len(history) * 5 + anchor) % (gamma + 1)``
            known tokens and give the next position confidence 0 (survival 1/2), so rounds end
            in partial acceptance and rejections, deterministically per history.
        "adversarial": propose, at the first position, the most probable recorded target token
            that the row's top-k / top-p / min-p filters exclude (a lossless verifier must
            never emit it).
        "off": the real drafter's block unchanged.
    Every proposal is a one-hot draft distribution that the token was really drawn from, so
    verification stays lossless whatever the oracle proposes.
    """

    def __init__(self, drafter, engine):
        self.drafter = drafter
        self.engine = engine
        self.mode = "greedy"
        self.proposed = 0  # tokens proposed from recordings so far (all modes)
        self.next_token: dict[tuple[int, ...], int] = {}
        self.ranked: dict[tuple[int, ...], list[tuple[int, float]]] = {}

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def learn(self, prompt_ids: list[int], output_ids: list[int],
              top_logprobs: list[dict[int, float]], overwrite: bool = True) -> None:
        """Record a finished request's continuation (with ``overwrite``, later recordings of a
        history win; without, earlier ones, e.g. greedy over sampled)."""
        seq = list(prompt_ids) + list(output_ids)
        for i, token in enumerate(output_ids):
            key = tuple(seq[:len(prompt_ids) + i])
            if overwrite or key not in self.next_token:
                self.next_token[key] = token
            if i < len(top_logprobs) and top_logprobs[i]:
                self.ranked[key] = sorted(top_logprobs[i].items(), key=lambda kv: -kv[1])

    def _proposal(self, history: list[int], top_k: int, top_p: float, min_p: float) -> list[int]:
        gamma = self.drafter.gamma
        if self.mode == "adversarial":
            ranked = self.ranked.get(tuple(history))
            keep = allowed_count(ranked, top_k, top_p, min_p) if ranked else None
            return [ranked[keep][0]] if keep is not None and keep < len(ranked) else []
        out, seq = [], list(history)
        while len(out) < gamma and (t := self.next_token.get(tuple(seq))) is not None:
            out.append(t)
            seq.append(t)
        if self.mode == "mixed":
            out = out[:(len(history) * 5 + history[-1]) % (gamma + 1)]
        return out

    def draft(self, cache, slots, anchor_tokens, anchor_positions, sampling,
              uniforms) -> DraftBlock:
        block = self.drafter.draft(cache, slots, anchor_tokens, anchor_positions, sampling,
                                   uniforms)
        if self.mode == "off":
            return block
        tokens, probs = block.tokens.clone(), block.probs.clone()
        conf = torch.full_like(block.conf_logits, UNKNOWN_LOGIT)
        by_slot = {r.slot: r for r in self.engine.running}  # called inside engine.step()
        for i, slot in enumerate(slots.tolist()):
            req = by_slot[slot]
            history = req.prompt_ids + req.output_ids
            assert len(history) == int(anchor_positions[i]) + 1
            proposal = self._proposal(history, int(sampling.top_k[i]), float(sampling.top_p[i]),
                                      float(sampling.min_p[i]))
            self.proposed += len(proposal)
            for k, t in enumerate(proposal):
                tokens[i, k] = t
                probs[i, k] = 0.0
                probs[i, k, t] = 1.0
                conf[i, k] = KNOWN_LOGIT
            if self.mode == "mixed" and len(proposal) < tokens.shape[1]:
                conf[i, len(proposal)] = 0.0
        return DraftBlock(tokens, probs, conf)


class Recorder:
    """Wraps an engine's ``add_request`` and ``step`` to keep, per engine request id, the prompt,
    params, committed token ids and top logprobs; finished greedy requests go to ``on_greedy``."""

    def __init__(self, engine, on_greedy=None):
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, object] = {}
        self.tokens: dict[str, list[int]] = {}
        self.top: dict[str, list[dict[int, float]]] = {}
        self.on_greedy = on_greedy
        add, step = engine.add_request, engine.step

        def add_request(request_id, prompt_token_ids, params):
            add(request_id, prompt_token_ids, params)
            self.prompts[request_id] = list(prompt_token_ids)
            self.params[request_id] = params
            self.tokens[request_id], self.top[request_id] = [], []

        def recorded_step():
            try:
                outputs = step()
            except RequestFailed as exc:
                self._record(exc.outputs)
                raise
            self._record(outputs)
            return outputs

        engine.add_request, engine.step = add_request, recorded_step

    def _record(self, outputs) -> None:
        for out in outputs:
            rid = out.request_id
            self.tokens[rid] += out.new_token_ids
            self.top[rid] += out.new_top_logprobs or [{} for _ in out.new_token_ids]
            if out.finished and self.on_greedy is not None and self.params[rid].temperature == 0:
                self.on_greedy(self.prompts[rid], self.tokens[rid], self.top[rid])

    def request_ids(self, body: dict) -> list[str]:
        """Engine request ids of a (single-prompt) response's choices, in choice order."""
        base = body["id"].split("-", 1)[1]
        return [f"{base}-{i}" for i in range(len(body["choices"]))]

    def choice_tokens(self, body: dict) -> list[list[int]]:
        return [self.tokens[rid] for rid in self.request_ids(body)]

    def choice_prompt(self, body: dict) -> list[int]:
        return self.prompts[self.request_ids(body)[0]]
