import argparse

import pytest

from dspark_serve.bench import draft_profile
from tests.training.conftest import make_drafter, make_target

KEYS = {"R", "width", "draft_ms", "backbone_ms", "lm_head_ms", "sampling_ms",
        "context_us_per_token", "step_ms", "share"}


def test_draft_times_on_a_tiny_pair():
    target = make_target()
    drafter = make_drafter(target).eval().requires_grad_(False)
    record = draft_profile.draft_times(target, drafter, 2, context=12, repeats=3)
    assert set(record) == KEYS and record["R"] == 2 and record["width"] == drafter.gamma
    assert draft_profile.draft_times(target, drafter, 1, context=12, width=1,
                                     repeats=1)["width"] == 1
    for key in ("draft_ms", "lm_head_ms", "step_ms", "share", "context_us_per_token"):
        assert record[key] > 0, key
    # the share is a ratio of the two measured times, per repeat: within their spread
    assert 0.2 * record["draft_ms"] / record["step_ms"] < record["share"] \
        < 5 * record["draft_ms"] / record["step_ms"]
    with pytest.raises(ValueError, match="requests and context"):
        draft_profile.draft_times(target, drafter, 0, context=12)
    with pytest.raises(ValueError, match="width must be in"):
        draft_profile.draft_times(target, drafter, 1, context=12, width=drafter.gamma + 1)


def test_draft_table_marks_the_budget():
    rows = [{"R": 1, "width": 7, "draft_ms": 1.0, "backbone_ms": 0.5, "lm_head_ms": 0.25,
             "sampling_ms": 0.25, "context_us_per_token": 40.0, "step_ms": 10.0, "share": 0.1},
            {"R": 4, "width": 3, "draft_ms": 6.0, "backbone_ms": 3.0, "lm_head_ms": 1.0,
             "sampling_ms": 2.0, "context_us_per_token": 20.0, "step_ms": 12.0, "share": 0.5}]
    lines = draft_profile.format_draft_table(rows).splitlines()
    assert lines[1].split() == ["1", "7", "1.00", "0.50", "0.25", "0.25", "40.0", "10.00", "10",
                                "%", "ok"]
    assert lines[2].split()[-3:] == ["50", "%", "over"]
    assert lines[3] == "(budget: a draft <= 15 % of the target decode step)"


def test_parser_defaults():
    parser = argparse.ArgumentParser()
    draft_profile.add_parser(parser.add_subparsers())
    args = parser.parse_args(["draft", "--requests", "1,8"])
    assert args.requests == [1, 8] and args.quantization == "int4" and args.threads == 1
    assert args.widths is None
    assert parser.parse_args(["draft", "--widths", "7,3"]).widths == [7, 3]
    assert args.func is draft_profile.main
