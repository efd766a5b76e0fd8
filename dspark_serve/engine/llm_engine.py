"""The embedded engine: continuous batching with DSpark speculative decoding.

One ``step()`` = schedule -> run -> verify -> postprocess:

1. schedule (``RequestScheduler``): reserve KV pages for every decoding request's next verify
   block (preempting the newest requests if the pool runs dry), admit waiting requests while
   the pool has pages for them; pick prefill chunks (at most ``prefill_chunk`` prompt tokens
   per step) and the decoding requests;
2. run (``ModelRunner``): draft a block for every decoding request and schedule its verify
   length l_r (``Speculator``), fit drafts to grammars, then run ONE target forward over the
   flattened tokens of all requests (prefill chunks + anchor and l_r drafts per decoding
   request), laid out once in ``SpecMetadata``;
3. verify (``TargetSampler``): the target distribution at every verified position
   (penalties with the drafted history, logit bias, the grammar mask after the drafted tokens,
   warping), seeded replay and rejection sampling;
4. postprocess: commit token by token with stop strings, stop tokens, EOS and max_tokens
   checked after each token; the anchor and accepted drafts enter the drafter's context;
   finished requests free their KV pages.

Plain decoding (``speculative="none"``) is the same step with l_r = 0 and no drafter; so is
a step whose scheduler finds drafting not worth its time (``Speculator.should_draft``), except
that the committed token still enters the drafter's context.
"""
from __future__ import annotations

import threading
import time

import torch

from dspark_serve.engine.builder import build_engine
from dspark_serve.engine.config import EngineConfig
from dspark_serve.engine.detokenizer import IncrementalDetokenizer
from dspark_serve.engine.model_runner import ModelRunner
from dspark_serve.engine.outputs import RequestOutput, StepStats
from dspark_serve.engine.params import SamplingParams
from dspark_serve.engine.postprocess import postprocess
from dspark_serve.engine.request import Request
from dspark_serve.engine.request_scheduler import RequestScheduler
from dspark_serve.engine.sampling_batch import sampling_batch
from dspark_serve.model.target_weights import TargetWeights
from dspark_serve.structured.compiler import GrammarCompiler
from dspark_serve.structured.spec import GrammarSpec
from dspark_serve.verify.target_sampler import TargetSampler


class LLMEngine:
    """Single-threaded engine; see the module docstring for the step.

    Attributes:
        tokenizer: the target's Hugging Face tokenizer (with its chat template).
        model_name: served model name. max_model_len: context limit in tokens.
        vocab_size: V. gamma: draft tokens per round (0 without speculation).
        target, kv, speculator, generator: see ``builder.EngineParts``.
    Args:
        config: what to load and serve.
        target_weights: another engine's ``target.weights`` to share (``builder.build_engine``).
    Raises:
        ValueError: an inconsistent configuration (``builder.build_engine``).
    """

    def __init__(self, config: EngineConfig, target_weights: TargetWeights | None = None):
        parts = build_engine(config, target_weights)
        self.config = config
        self.tokenizer, self.model_name = parts.tokenizer, parts.model_name
        self.eos_ids, self.max_model_len = parts.eos_ids, parts.max_model_len
        self.vocab_size, self.gamma = parts.vocab_size, parts.gamma
        self.target, self.kv, self.speculator = parts.target, parts.kv, parts.speculator
        self.device, self.generator = parts.target.device, parts.generator
        self.scheduler = RequestScheduler(
            self.kv, config.prefill_chunk, gamma=self.gamma, max_model_len=self.max_model_len,
            on_admit=self.speculator.reset_slot if self.speculator is not None else None)
        self.runner = ModelRunner(self.target, self.kv, self.speculator, gamma=self.gamma,
                                  max_model_len=self.max_model_len,
                                  mask_drafts=config.mask_drafts)
        self.sampler = TargetSampler(self.vocab_size)
        self._step_stats: list[StepStats] = []
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use (~0.5 s)
        self._grammar_lock = threading.Lock()

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far because the KV pool ran out of pages."""
        return self.scheduler.num_preemptions

    # ---- public API (see dspark_serve.server.async_engine) ---------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request. Raises ValueError for an empty or too long prompt, token ids
        outside the vocabulary, a duplicate id or invalid parameters (``GrammarError`` for
        a structured-output spec that does not compile)."""
        params.validate(self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the context limit "
                             f"is {self.max_model_len} including at least one completion token")
        if self.scheduler.holds(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed & (2**63 - 1))
        request = Request(request_id, list(prompt_token_ids), params,
                          IncrementalDetokenizer(self.tokenizer, params.stop), generator)
        if params.structured is not None:
            request.grammar = self.grammar_compiler().new_state(params.structured)
        self.scheduler.add(request)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (built on first call;
        thread-safe, so the server compiles new specs off the engine thread and
        ``add_request`` finds them cached)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                         sorted(self.eos_ids))
            return self._grammar_compiler

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` into the cache. Raises GrammarError (a ValueError naming the
        request field) for a schema or regex that cannot be served."""
        self.grammar_compiler().compile(spec)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV pages now; unknown or finished ids are ignored."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_free_tokens(self) -> int:
        """KV token positions new requests can still take (``KVCache.free_tokens``)."""
        return self.kv.free_tokens

    def pop_step_stats(self) -> list[StepStats]:
        """Statistics of the steps since the last call."""
        stats, self._step_stats = self._step_stats, []
        return stats

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step over all running requests; returns their output deltas.

        Raises:
            RequestFailed: committing one request failed; it was dropped, the outputs of the
                others are attached.
        """
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        stats = StepStats(num_running=len(self.running), num_waiting=len(self.waiting))
        batch = sampling_batch(plan.verify_requests, self.vocab_size, self.device,
                               self.generator)
        run = self.runner.run(plan, batch)
        verdict = self.sampler.verify(run.logits, run.meta, batch)
        self.runner.observe(plan, run, verdict)
        outputs, failure, context = postprocess(
            plan, run, verdict, stats, eos_ids=self.eos_ids, max_model_len=self.max_model_len,
            gamma=self.gamma, release=self.scheduler.release)
        self.runner.extend_context(context, run.taps)
        for req in [r for r in plan.verify_requests if r.finished]:
            self.scheduler.release(req)
        stats.step_seconds = time.perf_counter() - start
        self.runner.observe_step(run, stats.step_seconds)
        stats.grammar_seconds = run.grammar_seconds + verdict.grammar_seconds
        self._step_stats.append(stats)
        if failure is not None:
            failure.outputs = outputs
            raise failure
        return outputs
