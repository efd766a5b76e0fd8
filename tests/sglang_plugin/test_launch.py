"""``serve --backend sglang`` argument building (no sglang needed; nothing is launched)."""
import argparse

import pytest

from dspark_serve.server.cli import add_parser
from dspark_serve.sglang_plugin.launch import build_sglang_argv


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_argv_for_dspark_with_passthrough():
    args = _parse(["--backend", "sglang", "--gamma", "6", "--cost-table", "sps.json",
                   "--calibration", "sts.json", "--port", "9000", "--dtype", "bfloat16",
                   "--", "--tp-size", "2", "--mem-fraction-static", "0.7"])
    assert args.backend == "sglang"
    argv = build_sglang_argv(args, "/m", "/d")
    assert argv == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "9000",
                    "--dtype", "bfloat16", "--context-length", "2048",
                    "--max-running-requests", "16", "--random-seed", "0", "--log-level", "info",
                    "--speculative-algorithm", "DSPARK_SERVE",
                    "--speculative-draft-model-path", "/d",
                    "--speculative-dspark-sps-table-path", "sps.json",
                    "--speculative-num-draft-tokens", "7",
                    "--speculative-dspark-confidence-sts-path", "sts.json",
                    "--tp-size", "2", "--mem-fraction-static", "0.7"]


def test_argv_without_speculation_and_errors():
    argv = build_sglang_argv(_parse(["--backend", "sglang", "--speculative", "none"]), "/m", None)
    assert "--speculative-algorithm" not in argv and argv[:2] == ["--model-path", "/m"]
    with pytest.raises(ValueError, match="--cost-table"):
        build_sglang_argv(_parse(["--backend", "sglang"]), "/m", "/d")
    with pytest.raises(ValueError, match="--draft"):
        build_sglang_argv(_parse(["--backend", "sglang", "--cost-table", "t"]), "/m", None)
    with pytest.raises(ValueError, match="asynchronous"):
        build_sglang_argv(_parse(["--backend", "sglang", "--scheduler", "static",
                                  "--cost-table", "t"]), "/m", "/d")


def test_embedded_stays_default():
    assert _parse([]).backend == "embedded" and _parse([]).sglang_args == []
