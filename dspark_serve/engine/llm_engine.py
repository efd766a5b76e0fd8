"""The embedded engine: continuous batching with DSpark speculative decoding.

One ``step()`` = schedule, run, commit:

1. reserve KV pages for every decoding request's next verify block (preempting the newest
   requests if the pool runs dry, see below), admit waiting requests while the pool has pages
   for them; pick prefill chunks (at most ``prefill_chunk`` prompt tokens per step) and the
   decoding requests;
2. draft a block for every decoding request and schedule its verify length l_r
   (``Speculator``), then run ONE target forward over the flattened tokens of all requests
   (prefill chunks + anchor and l_r drafts per decoding request);
3. build the target distribution at every verified position (penalties with the drafted
   history, logit bias, the grammar mask after the drafted tokens, warping), verify by
   rejection sampling (``verify.rejection``), and commit token by token with stop strings,
   stop tokens, EOS and max_tokens checked after each token; the anchor and accepted drafts
   enter the drafter's context.

Grammar-constrained requests (``dspark_serve.structured``) also have their drafts fitted to
the grammar between 2's drafting and the target forward.

Plain decoding (``speculative="none"``) is the same step with l_r = 0 and no drafter; so is
a step whose scheduler finds drafting not worth its time (``Speculator.should_draft``), except
that the committed token still enters the drafter's context.

KV memory is a pool of pages (``engine.kv_cache``, ``EngineConfig.kv_cache_tokens``). A
waiting request is admitted, in arrival order, once a slot and pages for its prompt, its first
token and one draft block are free; a decoding request gets pages for its anchor and gamma
drafts before each step. When the pool cannot grow a decoding request, the newest running
request is preempted as in vLLM: its pages are freed and it goes back to the head of the
queue with its tokens so far, to be recomputed (prefilled again, without sampling) when pages
free up. The pool holds at least one request of max_model_len, so the oldest request always
fits: the engine never stalls, and preemption changes no token (its K/V are recomputed from
the same tokens).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from dspark_serve.calibration.lookup import LookupCalibration
from dspark_serve.engine.batch import StepPlan, plan_step
from dspark_serve.engine.commit import commit_tokens
from dspark_serve.engine.config import DRAFTER_MODES, LOOKUP_MODES, EngineConfig
from dspark_serve.engine.detokenizer import IncrementalDetokenizer
from dspark_serve.engine.outputs import RequestFailed, RequestOutput, SpecStats, StepStats
from dspark_serve.engine.params import SamplingParams
from dspark_serve.engine.penalties import apply_penalties, block_history_counts
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_state import penalty_state, replay_seeded, sampling_tensors
from dspark_serve.engine.speculator import LookupConfig, Speculator
from dspark_serve.engine.target_model import TargetModel
from dspark_serve.sampling.sampler import draw_uniforms
from dspark_serve.sampling.warping import warp_probs
from dspark_serve.structured.compiler import GrammarCompiler
from dspark_serve.structured.masking import constrain_drafts, mask_logits, verify_bitmask
from dspark_serve.structured.spec import GrammarSpec
from dspark_serve.verify.rejection import rejection_sample

logger = logging.getLogger(__name__)


class LLMEngine:
    """Single-threaded engine; see the module docstring for the step.

    Attributes:
        tokenizer: the target's Hugging Face tokenizer (with its chat template).
        model_name: served model name. max_model_len: context limit in tokens.
        vocab_size: V. gamma: draft tokens per round (0 without speculation).
    Raises:
        ValueError: an inconsistent configuration (drafter does not fit the target, gamma
            larger than the drafter's block, bad calibration or cost table).
    """

    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig, AutoTokenizer

        from dspark_serve.models.default_drafter import LOOKUP_GAMMA, build_drafter, drafter_source
        from dspark_serve.models.default_model import MODEL_NAME, default_model_path

        self.config = config
        path = config.model or default_model_path()
        self.model_name = Path(path).name if config.model else MODEL_NAME
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        hf_config = AutoConfig.from_pretrained(path)
        self.eos_ids = _eos_ids(self.tokenizer, hf_config)
        model_len = getattr(hf_config, "max_position_embeddings", None)
        if config.max_model_len is None and model_len is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        self.max_model_len = min(config.max_model_len or model_len, model_len or 1 << 30)
        draft_path = draft_config = None
        if config.speculative in DRAFTER_MODES:
            mask_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            kind = "dspark" if config.speculative == "hybrid" else config.speculative
            draft_path, draft_config = drafter_source(hf_config, kind, self.model_name, mask_id,
                                                      config.draft)
        taps = draft_config.target_layer_ids if draft_config else ()
        self.target = TargetModel.from_pretrained(path, dtype=config.dtype, target_layer_ids=taps,
                                                  quantization=config.quantization)
        self.device = self.target.device
        self.vocab_size = int(hf_config.vocab_size)
        self.kv = self.target.new_kv_cache(config.max_num_seqs, self.max_model_len,
                                           config.kv_pool_tokens(self.max_model_len))
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.speculator: Speculator | None = None
        self.gamma = 0
        if config.speculative != "none":
            drafter = (build_drafter(self.target, draft_path, draft_config, seed=config.seed)
                       if draft_config is not None else None)
            lookup = (LookupConfig(min_match=config.lookup_min_match,
                                   calibration=self._lookup_calibration())
                      if config.speculative in LOOKUP_MODES else None)
            self.gamma = config.gamma or (drafter.gamma if drafter else LOOKUP_GAMMA)
            scheduler = "static" if config.speculative == "dflash" else config.scheduler
            self.speculator = Speculator(
                drafter, lookup=lookup, vocab_size=self.vocab_size, gamma=self.gamma,
                scheduler=scheduler, cost_table=self._cost_table(scheduler),
                temperatures=self._sts(draft_path) if drafter else None,
                threshold=config.threshold, max_batch_tokens=config.max_batch_tokens,
                num_slots=config.max_num_seqs, max_len=self.max_model_len,
                always_draft=config.always_draft)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._step_stats: list[StepStats] = []
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use (~0.5 s)
        self._grammar_lock = threading.Lock()
        self._grammar_seconds = 0.0  # this step's grammar work

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
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed & (2**63 - 1))
        request = Request(request_id, list(prompt_token_ids), params,
                          IncrementalDetokenizer(self.tokenizer, params.stop), generator)
        if params.structured is not None:
            request.grammar = self.grammar_compiler().new_state(params.structured)
        self.waiting.append(request)

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
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        for r in [r for r in self.running if r.request_id == request_id]:
            self._release(r)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        self._grammar_seconds = 0.0
        self._reserve_decode_pages()
        self._admit()
        if not self.running:
            return []
        plan = plan_step(self.running, self.config.prefill_chunk)
        stats = StepStats(num_running=len(self.running), num_waiting=len(self.waiting))
        if plan.decode and self.speculator is not None \
                and self.speculator.should_draft(len(plan.decode)):
            self._propose(plan)
            self._constrain_drafts(plan)
        d = self.device
        ids, slots, pos, starts = plan.flat_tokens()
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=d)
        out = self.target.forward(as_tensor(ids), as_tensor(slots), as_tensor(pos), self.kv,
                                  as_tensor(plan.logit_indices(starts)))
        reqs = plan.verify_requests
        lengths = plan.verify_lengths()
        result = self._verify(plan, reqs, lengths, out.logits) if reqs else None
        logit_start = (torch.cumsum(lengths + 1, 0) - (lengths + 1)).tolist()
        outputs, failure = [], None
        context = _ContextUpdates()
        for i, req in enumerate(reqs):
            try:
                n_acc = int(result.num_accepted[i])
                tokens = result.tokens[i, :n_acc + 1].tolist()
                rows = (out.logits[logit_start[i]:logit_start[i] + len(tokens)]
                        if req.params.logprobs else None)
                stats.generated_tokens += commit_tokens(req, tokens, rows, self.eos_ids,
                                                        self.max_model_len)
                if i < len(plan.decode):
                    if plan.block is not None:  # a step that skipped drafting is no round
                        self._record_round(stats, req, int(lengths[i]), n_acc)
                    if not req.finished:  # anchor + accepted drafts now have target K/V
                        context.add(starts[i], req.slot, req.num_tokens - n_acc - 2, n_acc + 1)
                        req.num_computed = req.num_tokens - 1
                outputs.append(self._output(req))
            except Exception as exc:  # one bad request must not take the others down
                logger.exception("request %s failed", req.request_id)
                self._release(req)
                failure = failure or RequestFailed(req.request_id, f"internal error: {exc}")
        for k, (req, n) in enumerate(plan.prefill):
            if req.slot >= 0 and not req.finished:
                context.add(starts[len(plan.decode) + k], req.slot, req.num_computed, n)
                req.num_computed += n
        if self.speculator is not None:
            self.speculator.extend(*context.tensors(out.taps, d))
        for req in [r for r in reqs if r.finished]:
            self._release(req)
        stats.step_seconds = time.perf_counter() - start
        stats.grammar_seconds = self._grammar_seconds
        self._step_stats.append(stats)
        if failure is not None:
            failure.outputs = outputs
            raise failure
        return outputs

    # ---- step phases ----------------------------------------------------------------------

    def _reserve_decode_pages(self) -> None:
        """Give every decoding request, oldest first, pages for this step's writes: its anchor
        and up to gamma drafts (positions up to num_tokens - 1 + gamma). When the pool runs
        dry, preempt the newest running request (possibly the one growing) and retry."""
        for req in list(self.running):
            if req not in self.running or req.prefilling:  # preempted, or pages reserved
                continue
            need = min(req.num_tokens + self.gamma, self.max_model_len)
            while not self.kv.reserve(req.slot, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break

    def _preempt(self, req: Request) -> None:
        """Free a running request's pages and queue it first to be recomputed
        (``Request.prefill_len``); its tokens, sampling state and grammar state stay."""
        self._release(req)
        req.num_computed = 0
        self.waiting.insert(0, req)
        self.num_preemptions += 1
        logger.info("KV pool full: request %s preempted (%d tokens to recompute)",
                    req.request_id, req.prefill_len)

    def _admit(self) -> None:
        """Admit waiting requests in arrival order while a slot and pages for the prompt (or a
        preempted request's tokens), the first token and one draft block are free; the head of
        the queue waits for pages rather than being overtaken."""
        while self.waiting:
            req = self.waiting[0]
            need = min(req.num_tokens + 1 + self.gamma, self.max_model_len)
            if not self.kv.can_allocate(need):
                break
            self.waiting.pop(0)
            req.slot = self.kv.allocate(need)
            if self.speculator is not None:
                self.speculator.reset_slot(req.slot)
            self.running.append(req)

    def _propose(self, plan: StepPlan) -> None:
        """Draft and schedule the decoding requests (fills plan.block / plan.lengths)."""
        reqs, d = plan.decode, self.device
        caps = torch.tensor([max(0, min(self.gamma, r.params.max_tokens - len(r.output_ids) - 1,
                                        self.max_model_len - r.num_tokens - 1)) for r in reqs],
                            dtype=torch.int64, device=d)
        gens = [r.generator or self.generator for r in reqs]
        drafter = self.speculator.drafter
        plan.block, lengths = self.speculator.propose(
            torch.tensor([r.slot for r in reqs], device=d),
            torch.tensor([r.anchor for r in reqs], device=d),
            torch.tensor([r.num_tokens - 1 for r in reqs], device=d),
            [r.prompt_ids + r.output_ids for r in reqs], sampling_tensors(reqs, d),
            draw_uniforms(gens, drafter.gamma if drafter else 0, d), caps)
        plan.lengths = lengths.cpu()
        plan.gamma = self.gamma

    def _constrain_drafts(self, plan: StepPlan) -> None:
        """Fit the drafted blocks of grammar-constrained requests to their grammars
        (``structured.masking.constrain_drafts``; shortens ``plan.lengths``)."""
        states = [r.grammar for r in plan.decode]
        if all(s is None for s in states):
            return
        start = time.perf_counter()
        uniforms = None
        if self.config.mask_drafts:
            uniforms = draw_uniforms([r.generator or self.generator for r in plan.decode],
                                     plan.gamma, self.device)
        plan.lengths = plan.lengths.clone()
        constrain_drafts(states, plan.block.tokens, plan.block.probs, plan.lengths, uniforms)
        self._grammar_seconds += time.perf_counter() - start

    def _verify(self, plan: StepPlan, reqs: list[Request], lengths: torch.Tensor,
                logits: torch.Tensor):
        """Target distributions at every verified position, then rejection sampling."""
        d, g = self.device, plan.gamma
        lengths = lengths.to(d)
        rows = torch.repeat_interleave(torch.arange(len(reqs), device=d), lengths + 1)
        drafts, draft_probs = plan.verify_drafts(d)
        state = penalty_state(reqs, self.vocab_size, d)
        if state is not None:
            history = block_history_counts(drafts, lengths, self.vocab_size) if g else None
            logits = apply_penalties(logits, rows, state, history)
        states = [r.grammar for r in reqs]
        if any(s is not None for s in states):
            start = time.perf_counter()
            bitmask, masked = verify_bitmask(states, drafts.cpu(), lengths.tolist(),
                                             self.vocab_size)
            logits = mask_logits(logits, bitmask, masked)
            self._grammar_seconds += time.perf_counter() - start
        probs = warp_probs(logits, sampling_tensors(reqs, d).select(rows))
        cols = torch.arange(rows.numel(), device=d) - torch.repeat_interleave(
            torch.cumsum(lengths + 1, 0) - (lengths + 1), lengths + 1)
        target_probs = probs.new_zeros(len(reqs), g + 1, self.vocab_size)
        target_probs[rows, cols] = probs
        replay_seeded(target_probs, reqs, lengths)
        if draft_probs is None:
            draft_probs = probs.new_zeros(len(reqs), 0, self.vocab_size)
        u = draw_uniforms([r.generator or self.generator for r in reqs], g + 1, d)
        return rejection_sample(target_probs, drafts, draft_probs, lengths,
                                u[:, :g].contiguous(), u[:, g].contiguous())

    def _record_round(self, stats: StepStats, req: Request, l_r: int, n_acc: int) -> None:
        if self.speculator is None:
            return
        req.record_round(self.gamma, n_acc)
        stats.rounds += 1
        stats.verify_tokens += l_r + 1
        stats.drafted_tokens += self.gamma
        stats.accepted_tokens += n_acc
        by_format = stats.rounds_by_format.setdefault(req.output_format, SpecStats())
        by_format.verify_rounds += 1
        by_format.drafted_tokens += self.gamma
        by_format.accepted_tokens += n_acc
        if not stats.accepted_per_position:
            stats.accepted_per_position = [0] * self.gamma
            stats.verified_per_position = [0] * self.gamma
        for k in range(l_r):
            stats.verified_per_position[k] += 1
            stats.accepted_per_position[k] += k < n_acc

    def _output(self, req: Request) -> RequestOutput:
        new_ids = req.output_ids[req.emitted_tokens:]
        req.emitted_tokens = len(req.output_ids)
        logprobs = top = None
        if req.params.logprobs:
            logprobs = req.logprobs[req.emitted_logprobs:]
            top = req.top_logprobs[req.emitted_logprobs:]
            req.emitted_logprobs = len(req.logprobs)
        return RequestOutput(req.request_id, new_ids, req.detokenizer.pop_delta(req.finished),
                             logprobs, top, req.finished, req.finish_reason,
                             len(req.prompt_ids), len(req.output_ids), req.stats)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.kv.free(req.slot)
            req.slot = -1

    # ---- start-up -------------------------------------------------------------------------

    def _cost_table(self, scheduler: str):
        from dspark_serve.scheduling import NEEDS_COST_TABLE
        from dspark_serve.scheduling.cost_table import CostTable

        if self.config.cost_table:
            return CostTable.load(self.config.cost_table)
        if scheduler not in NEEDS_COST_TABLE:
            return None
        from profiler import profile_cost_table

        max_b = self.config.max_batch_tokens or self.config.max_num_seqs * (
            (self.config.gamma or 16) + 1)
        logger.info("profiling SPS(B) up to B=%d on this machine (--cost-table skips this)", max_b)
        return profile_cost_table(self.target, self.kv, max_batch_tokens=max_b,
                                  context_len=min(256, self.max_model_len // 2),
                                  meta={"model": self.model_name})

    def _lookup_calibration(self) -> LookupCalibration | None:
        from dspark_serve.models.default_drafter import shipped_lookup_calibration

        path = self.config.lookup_calibration or shipped_lookup_calibration(self.model_name)
        return LookupCalibration.load(path) if path else None

    def _sts(self, draft_path: str | None):
        from dspark_serve.calibration.io import load_sts_calibration

        path = self.config.calibration
        if path is None and draft_path is not None:
            shipped = Path(draft_path) / "sts_calibration.json"
            path = str(shipped) if shipped.is_file() else None
        if path is None:
            return None
        return load_sts_calibration(path).temperatures_for(self.gamma, self.device)


def _eos_ids(tokenizer, hf_config) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(i) for i in ids if i is not None}


class _ContextUpdates:
    """Flat token indices whose target taps go into the drafter's context, with their
    (slot, position)."""

    def __init__(self):
        self.idx: list[int] = []
        self.slots: list[int] = []
        self.pos: list[int] = []

    def add(self, flat_start: int, slot: int, position: int, count: int) -> None:
        self.idx += range(flat_start, flat_start + count)
        self.slots += [slot] * count
        self.pos += range(position, position + count)

    def tensors(self, taps: torch.Tensor, device: torch.device):
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
        return as_tensor(self.slots), as_tensor(self.pos), taps.index_select(0, as_tensor(self.idx))
