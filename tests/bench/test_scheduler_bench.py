"""``dspark-serve bench scheduler``: grid coverage, JSON and table output, cost-table option."""
import json

import pytest

from dspark_serve.bench.scheduler import cpu_cost_table
from dspark_serve.cli import main
from dspark_serve.scheduling import SCHEDULER_NAMES


def test_json_covers_the_grid(capsys):
    assert main(["bench", "scheduler", "--json", "--requests", "1", "8", "--gamma", "2", "3",
                 "--repeats", "3", "--warmup", "1"]) == 0
    records = json.loads(capsys.readouterr().out)
    cells = {(r["scheduler"], r["R"], r["gamma"]) for r in records}
    assert cells == {(s, n, g) for s in SCHEDULER_NAMES for n in (1, 8) for g in (2, 3)}
    assert len(records) == len(cells)
    assert all(set(r) == {"scheduler", "R", "gamma", "median_us"} for r in records)
    assert all(r["median_us"] > 0 for r in records)


def test_table_and_cost_table_file(capsys, tmp_path):
    path = tmp_path / "sps.json"
    cpu_cost_table(64).save(path)
    assert main(["bench", "scheduler", "--requests", "4", "--gamma", "5", "--repeats", "2",
                 "--schedulers", "async", "static", "--cost-table", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["R", "gamma", "async", "static"]
    assert lines[1].split()[:2] == ["4", "5"] and len(lines[1].split()) == 4
    assert lines[-1] == "(median microseconds per scheduler call)"


def test_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "scheduler", "--repeats", "0"])
    with pytest.raises(SystemExit):
        main(["bench", "scheduler", "--schedulers", "greedy"])
    assert "invalid" in capsys.readouterr().err


def test_cost_table_too_small_for_the_grid(capsys, tmp_path):
    path = tmp_path / "sps.json"
    path.write_text('{"sample_batch_tokens":[1,8],"sample_steps_per_sec":[9.0,8.0],'
                    '"max_batch_tokens":8}')
    assert main(["bench", "scheduler", "--requests", "16", "--gamma", "2", "--repeats", "1",
                 "--cost-table", str(path)]) == 2
    assert "more than the limit of 8" in capsys.readouterr().err
