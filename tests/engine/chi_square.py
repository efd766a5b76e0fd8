"""Chi-square helpers of the engine's statistical lossless tests: samples of short outputs
binned into the most likely sequences of an exact distribution, plus one bin for the rest."""
import numpy as np
from scipy import stats


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
