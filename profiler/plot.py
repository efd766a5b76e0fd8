"""PNG of a profile: SPS(B) (steps/s) and target tokens/s = B * SPS(B) against batch tokens B,
one line per context length (the cliffs the scheduler must see, paper Section 5.2)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the profiler runs on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

from dspark_serve.profiling.sps import SpsProfile  # noqa: E402


def plot_profile(profile: SpsProfile, path: str | Path, title: str = "") -> Path:
    """Write the two-panel figure to ``path`` (PNG); returns the path."""
    fig, (ax_sps, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in profile.context_lens:
        ts = profile.step_seconds[c]
        b = profile.batch_tokens[:len(ts)]
        sps = [1.0 / t for t in ts]
        ax_sps.plot(b, sps, marker=".", label=f"context {c}")
        ax_tps.plot(b, [n * s for n, s in zip(b, sps)], marker=".", label=f"context {c}")
    for ax, ylabel in ((ax_sps, "SPS(B)  [steps/s]"), (ax_tps, "B x SPS(B)  [tokens/s]")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch tokens B")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_sps.set_title("target steps per second")
    ax_tps.set_title("target tokens per second")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
