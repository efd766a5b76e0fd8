"""Sweep figures (paper Section 5.4): the throughput vs interactivity Pareto frontier per
configuration with SLA anchor lines (Figure 8 shape), and aggregate throughput, per-user speed
and verify budget per request against concurrency (Figure 9 shape)."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

X_KEY, Y_KEY = "median_tok_s_user", "aggregate_tok_s"
SLA_FRACTIONS = (0.5, 0.8)  # default anchors, as fractions of the fastest per-user speed seen


def load_summary(path: str | Path) -> list[dict]:
    """Rows of a ``summary.csv``: numbers parsed, empty cells None. Raises ValueError if the
    file lacks the summary columns."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"config", "concurrency", X_KEY, Y_KEY} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} is not a sweep summary (missing columns {sorted(missing)})")
        rows = []
        for raw in reader:
            row = {}
            for k, v in raw.items():
                if k in ("config", "status"):
                    row[k] = v
                elif v in ("", None):
                    row[k] = None
                else:
                    row[k] = int(v) if k == "concurrency" else float(v)
            rows.append(row)
    return rows


def pareto_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point dominates (>= on both axes, > on one), by ascending x (so
    descending y): the best throughput available at each per-user speed."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front[::-1]


def throughput_at_sla(front: list[tuple[float, float]], sla: float) -> float | None:
    """Highest measured throughput among frontier points meeting per-user speed >= ``sla``;
    None if no point meets it."""
    ys = [y for x, y in front if x >= sla]
    return max(ys) if ys else None


def default_sla(rows: list[dict]) -> list[float]:
    """Anchors at ``SLA_FRACTIONS`` of the fastest median tok/s/user, two significant digits."""
    fastest = max((r[X_KEY] for r in _usable(rows)), default=0.0)
    if fastest <= 0:
        return []
    return [round(f * fastest, 1 - int(math.floor(math.log10(f * fastest))))
            for f in SLA_FRACTIONS]


def _usable(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok"
            and r.get(X_KEY) is not None and r.get(Y_KEY) is not None]


def _by_config(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in _usable(rows):
        out.setdefault(r["config"], []).append(r)
    return {c: sorted(rs, key=lambda r: r["concurrency"]) for c, rs in out.items()}


def plot_pareto(rows: list[dict], path: str | Path, sla: list[float] | None = None) -> Path:
    """Aggregate output tok/s against median tok/s/user, one frontier per configuration,
    points labelled with their concurrency, dashed SLA anchors with each configuration's
    best throughput meeting them in the legend."""
    sla = default_sla(rows) if sla is None else sla
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for config, rs in _by_config(rows).items():
        pts = [(r[X_KEY], r[Y_KEY]) for r in rs]
        front = pareto_frontier(pts)
        at = [throughput_at_sla(front, s) for s in sla]
        label = config + "".join(f"; @{s:g}: {a:.0f}" if a is not None else f"; @{s:g}: -"
                                 for s, a in zip(sla, at))
        line, = ax.plot(*zip(*front), marker="o", label=label)
        ax.scatter(*zip(*pts), color=line.get_color(), alpha=0.5, s=18)
        for r in rs:
            ax.annotate(f"c{r['concurrency']}", (r[X_KEY], r[Y_KEY]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    for s in sla:
        ax.axvline(s, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"SLA {s:g} tok/s/user", (s, 0), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, color="grey", xytext=(-9, 5),
                    textcoords="offset points", va="bottom")
    ax.set_xlabel("median per-user speed  [tok/s/user]")
    ax.set_ylabel("aggregate output throughput  [tok/s]")
    ax.set_title("Throughput vs interactivity (legend: tok/s at each SLA)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_load(rows: list[dict], path: str | Path) -> Path:
    """Three panels against concurrency: aggregate tok/s, median tok/s/user, and target
    positions verified per request per step (configurations without speculation have none)."""
    panels = ((Y_KEY, "aggregate output  [tok/s]"), (X_KEY, "median  [tok/s/user]"),
              ("verify_budget_per_request", "verify budget  [tokens/request/step]"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    levels = sorted({r["concurrency"] for r in _usable(rows)})
    for config, rs in _by_config(rows).items():
        for ax, (key, _) in zip(axes, panels):
            pts = [(r["concurrency"], r[key]) for r in rs if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=config)
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency  [users]")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Load dynamics: throughput and verify budget vs concurrency")
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep(summary_csv: str | Path, out_dir: str | Path | None = None,
               sla: list[float] | None = None) -> tuple[Path, Path]:
    """``pareto.png`` and ``load.png`` for a summary CSV (next to it by default)."""
    rows = load_summary(summary_csv)
    out_dir = Path(out_dir) if out_dir is not None else Path(summary_csv).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    return plot_pareto(rows, out_dir / "pareto.png", sla), plot_load(rows, out_dir / "load.png")


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

