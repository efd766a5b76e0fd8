"""What simulated users send and how long they pause: prompts from real sets, output lengths
from the sets' reference answers, exponential think time. Seeded per user, so a sweep sends the
same request sequence to every server configuration."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dspark_serve.data.prompt_sets import PROMPT_SETS, PromptRecord, load_records

CHARS_PER_TOKEN = 4.0  # English BPE rule of thumb: reference length in characters -> tokens
# Sets without reference answers (MT-Bench) draw lengths from a log-normal around this
# fraction of the cap, spread like chat answers (sigma of log length).
NO_REFERENCE_MEDIAN_FRACTION = 0.6
NO_REFERENCE_SIGMA = 0.5
THINK_CAP_FACTOR = 5.0  # longest pause, in mean think times (no minute-long stalls in a run)


@dataclass(frozen=True)
class WorkItem:
    """One request: the prompt's set, the user message, and its max_tokens."""

    prompt_set: str
    prompt: str
    max_tokens: int


class Workload:
    """Uniform over the given sets, then uniform over each set's prompts.

    Args:
        sets: set name -> its records (prompts already filtered).
        max_tokens: cap on every request's output length (tokens).
        min_tokens: floor on it.
        think_time_s: mean pause between a user's requests (exponential; 0 = none).
    Raises:
        ValueError: no sets, an empty set, or bounds out of order.
    """

    def __init__(self, sets: dict[str, list[PromptRecord]], *, max_tokens: int = 256,
                 min_tokens: int = 16, think_time_s: float = 1.0):
        if not sets or any(not records for records in sets.values()):
            raise ValueError("every prompt set must keep at least one prompt "
                             f"(sizes: { {k: len(v) for k, v in sets.items()} })")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        if think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {think_time_s}")
        self.sets = sets
        self.names = sorted(sets)
        self.max_tokens, self.min_tokens, self.think_time_s = max_tokens, min_tokens, think_time_s

    @classmethod
    def from_names(cls, names: list[str], *, max_prompt_chars: int = 2000,
                   **kwargs) -> "Workload":
        """Load the named sets (``dspark_serve.data.prompt_sets``), dropping prompts longer
        than ``max_prompt_chars`` characters (ShareGPT holds multi-page pastes)."""
        unknown = [n for n in names if n not in PROMPT_SETS]
        if unknown:
            raise ValueError(f"unknown prompt sets {unknown}; choose from {', '.join(PROMPT_SETS)}")
        sets = {n: [r for r in load_records(n) if len(r.prompt) <= max_prompt_chars]
                for n in names}
        return cls(sets, **kwargs)

    def output_tokens(self, record: PromptRecord, rng: random.Random) -> int:
        """max_tokens for ``record``: its reference answer's estimated length, else a
        log-normal draw; clipped to [min_tokens, max_tokens]."""
        if record.reference:
            n = len(record.reference) / CHARS_PER_TOKEN
        else:
            n = rng.lognormvariate(math.log(NO_REFERENCE_MEDIAN_FRACTION * self.max_tokens),
                                   NO_REFERENCE_SIGMA)
        return int(min(max(round(n), self.min_tokens), self.max_tokens))

    def sample(self, rng: random.Random) -> WorkItem:
        name = rng.choice(self.names)
        record = rng.choice(self.sets[name])
        return WorkItem(name, record.prompt, self.output_tokens(record, rng))

    def think_time(self, rng: random.Random) -> float:
        """Seconds to pause before the next request (exponential, capped)."""
        if self.think_time_s == 0:
            return 0.0
        return min(rng.expovariate(1.0 / self.think_time_s),
                   THINK_CAP_FACTOR * self.think_time_s)
