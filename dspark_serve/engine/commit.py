"""Committing verified tokens to a request, one token at a time.

A verify round can emit up to gamma + 1 tokens, but the request must end exactly where
one-token-at-a-time decoding would have ended it: after each token the stop token ids, EOS,
stop strings, max_tokens and the context limit are checked, and the rest of the round is
dropped (no token ids, text or logprobs past the stop are returned). A grammar-constrained
request accepts each token into its grammar state (the verifier only ever emits allowed
tokens) and stops once the grammar has terminated (its stop token was accepted, which also
ends a request with ``ignore_eos``).
"""
from __future__ import annotations

import torch

from dspark_serve.engine.request import Request


def commit_tokens(req: Request, tokens: list[int], logits: torch.Tensor | None,
                  eos_ids: set[int], max_model_len: int) -> int:
    """Append ``tokens`` to ``req`` until a stop condition fires; returns how many were kept.

    Args:
        req: the request (``output_ids``, detokenizer, logprobs and finish_reason are updated).
        tokens: the round's accepted drafts followed by the recovered or bonus token.
        logits: [len(tokens), V] float32 raw target logits the tokens were sampled at (for
            logprobs), or None when the request does not ask for logprobs.
        eos_ids: end-of-sequence token ids (ignored with ``ignore_eos``).
        max_model_len: context limit in tokens.
    Raises:
        RuntimeError: the request's grammar forbids a token (a verifier bug; the engine fails
            this request only).
    """
    p = req.params
    logprobs = torch.log_softmax(logits.float(), dim=-1) if logits is not None else None
    for k, token in enumerate(tokens):
        if req.grammar is not None and not req.grammar.accept(token):
            raise RuntimeError(f"token {token} is forbidden by the request's grammar")
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(float(logprobs[k, token]))
            if p.top_logprobs:
                values, ids = logprobs[k].topk(p.top_logprobs)
                req.top_logprobs.append(dict(zip(ids.tolist(), values.tolist())))
            else:
                req.top_logprobs.append({})
        if token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos) or (
                req.grammar is not None and req.grammar.terminated):
            req.finish_reason = "stop"
        elif req.detokenizer.append(token):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
            req.finish_reason = "length"
        if req.finished:
            return k + 1
    return len(tokens)
