"""``DSparkServeWorker``: SGLang's DSPARK V2 worker with our scheduler, files and drafter check.

Reused from SGLang 0.5.23 unchanged (``speculative/dspark_components/dspark_worker_v2.py``,
``DSparkWorkerV2``): target/draft model runners, KV pools, attention backends with
``RaggedVerifyLayout``, CUDA-graph runners, the FutureMap confidence relay, verify and accept
kernels, ``GenerationBatchResult`` filling (``accept_lens``, ``block_accept_lens``,
``cap_lens``). Replaced by ours:

- drafter: loaded under our architecture (``DSparkServeDraftTpWorker`` renames the draft
  config's architecture, so the registry gives ``model.model_class()``, which checks the
  checkpoint with our ``DSparkConfig``);
- cost table and STS files: read and validated with ``CostTable.load`` / ``load_sts_calibration``;
- verify budget K: ``scheduling.LaggedBudgetPlanner`` (Section 5.2, conservative SPS);
- admission: ``scheduling.verify_lens_from_confidence`` (top-K of current slots), with
  penalised requests capped to 0 drafts (``verify_fixes.draft_caps``);
- min-p: the eager accept gets min-p-masked verify logits (``DSparkServeVerifyExecutor``), and
  min-p batches stay off SGLang's sampling-accept graph, which replays the accept without the
  mask. The folded in-graph accept is greedy only, where min-p never removes the argmax.
Imports sglang; load it through ``register`` only.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.managers.overlap_utils import CONFIDENCE_RELAY_RING_LAG
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.runtime_context import get_schedule, get_spec
from sglang.srt.speculative.dspark_components.dspark_planner import DSparkVerifyPlanner
from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

from dspark_serve.calibration.io import load_sts_calibration
from dspark_serve.scheduling.cost_table import CostTable
from dspark_serve.sglang_plugin import DRAFTER_ARCHITECTURE
from dspark_serve.sglang_plugin.scheduling import LaggedBudgetPlanner, verify_lens_from_confidence
from dspark_serve.sglang_plugin.verify_fixes import draft_caps, min_p_target_logits

logger = logging.getLogger(__name__)


class DSparkServeDraftTpWorker(TpModelWorker):
    """SGLang's draft ``TpModelWorker`` whose model config resolves to our architecture."""

    def _init_model_config(self):
        super()._init_model_config()
        if self.is_draft_worker:
            self.model_config.hf_config.architectures = [DRAFTER_ARCHITECTURE]


class DSparkServeVerifyPlanner(DSparkVerifyPlanner):
    """SGLang's planner with our top-K admission (``verify_lens_from_confidence``)."""

    row_caps: torch.Tensor | None = None

    def _schedule_verify_lens(self, *, req_pool_indices, prefix_lens, device, confidence,
                              budget):
        if self._budget_planner is None or confidence is None or budget is None:
            return None
        caps = self.row_caps
        if caps is not None and caps.shape[0] != confidence.shape[0]:
            caps = None     # padded (CUDA-graph / DP idle) rows: no per-request caps known
        verify_lens = verify_lens_from_confidence(confidence, int(budget), caps).to(device)
        self._tp_sync.sync(SpecTpSyncSite.DSPARK_PLAN, verify_lens)
        return verify_lens


class DSparkServeVerifyExecutor(TargetVerifyExecutor):
    """SGLang's verify executor whose eager accept sees the min-p target
    (``verify_fixes.min_p_target_logits``)."""

    def accept_and_finalize(self, *, folded_accept, target_logits, sampling_info, **kwargs):
        if (not folded_accept and target_logits is not None and sampling_info is not None
                and sampling_info.need_min_p_sampling):
            target_logits = min_p_target_logits(target_logits, sampling_info.temperatures,
                                                sampling_info.min_ps,
                                                self.verify_num_draft_tokens)
        return super().accept_and_finalize(folded_accept=folded_accept,
                                           target_logits=target_logits,
                                           sampling_info=sampling_info, **kwargs)


class DSparkServeWorker(DSparkWorkerV2):
    """The ``DSPARK_SERVE`` worker (module docstring). Same constructor as ``DSparkWorkerV2``."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker,
                 draft_worker_cls=DSparkServeDraftTpWorker):
        spec = get_spec()
        sts_path = spec.speculative_dspark_confidence_sts_path
        if sts_path:
            load_sts_calibration(sts_path)      # our stricter checks, before SGLang reads it
        cost_table = CostTable.load(spec.speculative_dspark_sps_table_path)
        super().__init__(server_args, gpu_id, nccl_port, target_worker,
                         draft_worker_cls=draft_worker_cls)
        executor = getattr(self, "_verify_executor", None)
        if type(executor) is TargetVerifyExecutor:
            executor.__class__ = DSparkServeVerifyExecutor
        if not self._hosts_draft:
            return
        planner = self._verify_planner
        if planner._budget_planner is None:
            logger.warning("SGLANG_RAGGED_VERIFY_MODE=static: every request verifies gamma "
                           "drafts; the DSpark-serve scheduler is idle")
            return
        relay = 0 if get_schedule().disable_overlap_schedule else CONFIDENCE_RELAY_RING_LAG
        planner._budget_planner = LaggedBudgetPlanner(cost_table, self.gamma,
                                                      relay_lag_steps=relay)
        planner.__class__ = DSparkServeVerifyPlanner

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, *,
                                 pp_proxy_tensors=None):
        if self._hosts_draft and isinstance(self._verify_planner, DSparkServeVerifyPlanner):
            self._verify_planner.row_caps = _penalty_caps(batch, self.gamma)
        return super().forward_batch_generation(batch, on_publish, grammar_barrier,
                                                pp_proxy_tensors=pp_proxy_tensors)


    def _sampling_graph_eligible(self, *, sampling_info, **kwargs) -> bool:
        if sampling_info is not None and sampling_info.need_min_p_sampling:
            return False
        return super()._sampling_graph_eligible(sampling_info=sampling_info, **kwargs)


def _penalty_caps(batch, gamma: int) -> torch.Tensor | None:
    reqs = getattr(batch, "reqs", None)
    if not reqs:
        return None
    penalised = [_has_penalty(r.sampling_params) for r in reqs]
    if not any(penalised):
        return None
    return draft_caps(gamma, torch.tensor(penalised, dtype=torch.bool))


def _has_penalty(params) -> bool:
    return (getattr(params, "frequency_penalty", 0.0) != 0.0
            or getattr(params, "presence_penalty", 0.0) != 0.0
            or getattr(params, "repetition_penalty", 1.0) != 1.0)
