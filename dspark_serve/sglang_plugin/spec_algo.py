"""``DSparkServeSpecAlgo``: how SGLang's scheduler sees the ``DSPARK_SERVE`` algorithm.

Our worker runs on SGLang's DSPARK machinery (``worker.DSparkServeWorker`` subclasses
``DSparkWorkerV2``), so every predicate SGLang dispatches on (``is_dspark``, ragged verify,
target-verify-for-draft, the FutureMap confidence relay, ...) answers as it does for the
builtin ``SpeculativeAlgorithm.DSPARK``. Imports sglang; load it through ``register`` only.

0.5.23 trap: the registry's conformance check only asks for the ``is_*``/``supports_*``
methods, but the scheduler also calls ``create_future_map`` (``managers/scheduler.py``),
``need_topk`` (``managers/overlap_utils.py``) and ``carries_draft_hidden_states``
(``managers/scheduler.py``); ``CustomSpecAlgo`` has none of them, so they are defined here.

Where SGLang tests the algorithm *object* against the builtin member (``batch.spec_algorithm
in (..., SpeculativeAlgorithm.DSPARK)`` in ``metrics_reporter``), the object compares equal to
``SpeculativeAlgorithm.DSPARK``; where it tests the configured *name*, ``algorithm_name`` does
the same for the string.
"""
from __future__ import annotations

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

_DSPARK = SpeculativeAlgorithm.DSPARK


class DSparkServeSpecAlgo(CustomSpecAlgo):
    """``CustomSpecAlgo`` answering like the builtin DSPARK, with our worker and checks."""

    def __eq__(self, other: object) -> bool:
        return other is self or other is _DSPARK

    # Identity hash (CustomSpecAlgo's): a dict keyed by SpeculativeAlgorithm.DSPARK does not
    # find this object; no SGLang 0.5.23 site keys algorithms that way (the site test checks).
    __hash__ = CustomSpecAlgo.__hash__

    def is_dspark(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return _DSPARK.supports_mixed_chunk()

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_ragged_verify(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    def need_topk(self) -> bool:
        """No EAGLE top-k tree: the FutureMap relays no topk_p / topk_index."""
        return False

    def carries_draft_hidden_states(self) -> bool:
        """Disaggregated prefill->decode sends no draft hidden states (EAGLE only)."""
        return False

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        """SGLang's ``FutureMap`` bound to this algorithm (as the builtin enum builds it)."""
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                         needs_confidence_relay)

    def handle_server_args(self, server_args) -> None:
        """SGLang's DSPARK server-arg handling (device, DP, KV reserve), then ours."""
        from sglang.srt.arg_groups.speculative_hook import _handle_dspark
        from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

        read_ragged_verify_mode()
        _handle_dspark(server_args)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                 is_draft_worker: bool) -> int:
        return num_draft_tokens - 1 if is_draft_worker else num_draft_tokens

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        from sglang.srt.speculative.dspark_disaggregation import build_dspark_disagg_draft_input

        return build_dspark_disagg_draft_input(batch, last_tokens_tensor, future_map)
