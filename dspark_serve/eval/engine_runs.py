"""Run prompts to completion through ``LLMEngine`` (the serving path, scheduler included):
the offline evaluation of the proposers that have no confidence logits to record (prompt
lookup, hybrid) and the greedy outputs the lookup calibration replays."""
from __future__ import annotations

from dataclasses import dataclass

from dspark_serve.engine.llm_engine import LLMEngine
from dspark_serve.engine.outputs import SpecStats
from dspark_serve.engine.params import SamplingParams


@dataclass
class Completion:
    """One prompt's output token ids and its speculative statistics (tau per round)."""

    token_ids: list[int]
    stats: SpecStats


def run_prompts(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                step_stats: list | None = None) -> list[Completion]:
    """Every prompt (token ids) through ``engine`` with ``params`` (up to the engine's
    max_num_seqs at once); completions in prompt order, the engine's ``StepStats`` appended
    to ``step_stats``. Raises as ``add_request``."""
    done = {str(i): Completion([], SpecStats()) for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id].token_ids += out.new_token_ids
            done[out.request_id].stats = out.stats
    (step_stats if step_stats is not None else []).extend(engine.pop_step_stats())
    return [done[str(i)] for i in range(len(prompts))]
