"""Pareto frontier helpers (exact) and the sweep figures from a synthetic summary CSV."""
from __future__ import annotations

import csv

import matplotlib.image
import pytest

from dspark_serve.loadtest.plot import (default_sla, load_summary, pareto_frontier, plot_sweep,
                           throughput_at_sla)
from dspark_serve.loadtest.summary import SUMMARY_FIELDS, failed_row


def test_pareto_frontier():
    pts = [(50, 10), (40, 30), (40, 25), (30, 20), (20, 60), (10, 55), (20, 60)]
    assert pareto_frontier(pts) == [(20, 60), (40, 30), (50, 10)]
    assert pareto_frontier([]) == []


def test_throughput_at_sla():
    front = [(20, 60), (40, 30), (50, 10)]
    assert throughput_at_sla(front, 15) == 60
    assert throughput_at_sla(front, 40) == 30
    assert throughput_at_sla(front, 45) == 10
    assert throughput_at_sla(front, 51) is None


def _rows():
    rows = []
    for config, speedup, budget in (("none", 1.0, None), ("dflash", 1.3, 8.0),
                                    ("dspark", 1.6, 6.0)):
        for c in (1, 2, 4, 8, 16):
            row = dict.fromkeys(SUMMARY_FIELDS)
            row.update(config=config, concurrency=c, status="ok",
                       median_tok_s_user=speedup * 40.0 / (1 + c / 8),
                       aggregate_tok_s=speedup * 40.0 * c / (1 + c / 8),
                       verify_budget_per_request=None if budget is None else budget / (1 + c / 16))
            rows.append(row)
    rows.append(failed_row("dspark", 32, "server_failed"))
    return rows


def test_default_sla():
    # fastest: dspark at c=1, 1.6 * 40 / 1.125 = 56.9; anchors 0.5 and 0.8 of it, 2 digits
    assert default_sla(_rows()) == pytest.approx([28.0, 46.0])


def test_plot_sweep(tmp_path):
    path = tmp_path / "summary.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(_rows())
    rows = load_summary(path)
    assert rows[0]["concurrency"] == 1 and rows[0]["verify_budget_per_request"] is None
    assert rows[-1]["status"] == "server_failed"
    pareto, load = plot_sweep(path, tmp_path / "figs", sla=[20.0, 40.0])
    assert pareto == tmp_path / "figs" / "pareto.png" and load == tmp_path / "figs" / "load.png"
    assert matplotlib.image.imread(pareto).shape[:2] == (660, 900)   # 7.5 x 5.5 in at 120 dpi
    assert matplotlib.image.imread(load).shape[:2] == (516, 1800)


def test_not_a_summary(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a sweep summary"):
        load_summary(path)
