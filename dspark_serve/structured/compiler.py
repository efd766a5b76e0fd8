"""xgrammar compilation against the target's tokenizer, and one request's matcher state.

Why xgrammar (measured with ``dspark-serve bench structured --masks`` on this project's shared
2-core CPU, SmolLM2 tokenizer, V = 49152, a nested-array schema): filling one position's
allowed-token mask costs ~12 us on average with xgrammar 0.2 vs ~87 us with outlines-core 0.2
(which writes the mask from its token index), compiling the schema ~26 ms vs ~470 ms
(outlines-core builds a regex index over the whole vocabulary); xgrammar's matcher also rolls
back accepted tokens natively (what speculative verification needs) and serves JSON objects of
any shape (not a regular language, so outlines-core can only approximate them).
"""
from __future__ import annotations

import re

import torch

from dspark_serve.structured.spec import GrammarError, GrammarSpec

# json_object: any JSON object; fixed separators (", " and ": ") like json_schema below,
# since free whitespace lets small models loop on newlines until max_tokens.
_ANY_OBJECT = '{"type": "object"}'
_CACHE_BYTES = 64 << 20
_XGR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer (thread-safe; results are cached).

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        vocab_size: V, the target's logit width (may exceed the tokenizer's vocabulary; the
            extra ids are never allowed).
        stop_token_ids: the engine's EOS ids: the grammar allows them exactly where the
            output may end.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``).

        Raises:
            GrammarError: the schema or regex is invalid or uses an unsupported feature (the
                backend's reason, without its source location).
        """
        try:
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            schema = _ANY_OBJECT if spec.kind == "json_object" else spec.source
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except (RuntimeError, ValueError) as exc:
            what = "'regex'" if spec.kind == "regex" else "'response_format.json_schema.schema'"
            reason = _XGR_LOCATION.sub("", str(exc).strip().splitlines()[0])
            raise GrammarError(spec.param, f"Invalid {what}: {reason}") from None

    def new_state(self, spec: GrammarSpec) -> "GrammarState":
        """A fresh matcher for one request (raises GrammarError like ``compile``)."""
        matcher = self._xgr.GrammarMatcher(self.compile(spec),
                                           override_stop_tokens=self.stop_token_ids)
        return GrammarState(matcher)


class GrammarState:
    """Where one request's output stands in its grammar (an xgrammar matcher).

    Tokens are accepted one at a time and can be rolled back (verification walks the drafted
    tokens, then returns to the committed output).
    """

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar forbids it here."""
        return self._matcher.accept_token(int(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """True once a stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ([N, ceil(V / 32)] int32).
        Must not be called once ``terminated``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
