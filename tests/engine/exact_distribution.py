"""Helpers of the engine's statistical lossless tests: exact target logits after given output
prefixes, and chi-square checks of samples binned into the most likely sequences of an exact
distribution, plus one bin for the rest."""
import numpy as np
import torch
from scipy import stats


def prefix_logits(target, prompt_ids: list[int], prefixes: list[tuple[int, ...]],
                  max_new: int) -> torch.Tensor:
    """[len(prefixes), V] float32 target logits of the token after prompt + each prefix, by
    direct target forwards (each sequence in its own scratch cache slot)."""
    cache = target.new_kv_cache(len(prefixes), len(prompt_ids) + max_new)
    ids, slots, pos, last = [], [], [], []
    for prefix in prefixes:
        seq, slot = prompt_ids + list(prefix), cache.allocate()
        ids += seq
        slots += [slot] * len(seq)
        pos += range(len(seq))
        last.append(len(ids) - 1)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)
    return target.forward(as_tensor(ids), as_tensor(slots), as_tensor(pos), cache,
                          as_tensor(last)).logits


def histogram(samples: list[tuple[int, ...]], bins) -> np.ndarray:
    """Counts of the binned sequences, then of all others."""
    index = {s: i for i, s in enumerate(bins)}
    counts = np.zeros(len(bins) + 1, dtype=np.int64)
    for s in samples:
        counts[index.get(s, len(bins))] += 1
    return counts


def goodness_of_fit(samples, exact, bins) -> float:
    """Chi-square p-value of the samples against the exact binned distribution."""
    p = np.array([exact[s] for s in bins] + [1.0 - sum(exact[s] for s in bins)])
    counts = histogram(samples, bins)
    assert (p * counts.sum()).min() >= 5, "expected counts too small for chi-square"
    return stats.chisquare(counts, p * counts.sum()).pvalue
