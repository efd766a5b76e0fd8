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
                   "--max-model-len", "2048",
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


def test_argv_context_and_pool_default_to_sglangs():
    argv = build_sglang_argv(_parse(["--backend", "sglang", "--speculative", "none"]), "/m", None)
    assert "--context-length" not in argv and "--max-total-tokens" not in argv
    argv = build_sglang_argv(_parse(["--backend", "sglang", "--speculative", "none",
                                     "--kv-cache-tokens", "65536"]), "/m", None)
    assert argv[argv.index("--max-total-tokens") + 1] == "65536"


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


@pytest.fixture
def served(monkeypatch):
    """Run ``dspark-serve`` main() with the serve action replaced by a recorder."""
    import dspark_serve.server.cli as serve_cli
    from dspark_serve.cli import main
    seen = []
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(args) or 0)

    def run(argv):
        assert main(argv) == 0
        return seen[-1]
    return run


def test_sglang_flags_pass_through_without_dashdash(served):
    args = served(["serve", "--backend", "sglang", "--tp-size", "2", "--port", "9000",
                   "--mem-fraction-static", "0.7", "--chunked-prefill-size", "-1",
                   "--enable-metrics", "--log-requests-level=2", "--gamma", "4",
                   "--", "--attention-backend", "fa3"])
    assert args.port == 9000 and args.gamma == 4 and args.backend == "sglang"
    assert args.sglang_args == ["--tp-size", "2", "--mem-fraction-static", "0.7",
                                "--chunked-prefill-size", "-1", "--enable-metrics",
                                "--log-requests-level=2", "--attention-backend", "fa3"]
    # Order of --backend does not matter; known flags stay ours.
    args = served(["serve", "--tp-size", "2", "--backend", "sglang", "--seed", "3"])
    assert args.sglang_args == ["--tp-size", "2"] and args.seed == 3


def test_pass_through_from_the_console_script_argv(monkeypatch, served):
    # the `dspark-serve` entry point calls main() without arguments: sys.argv is read
    monkeypatch.setattr("sys.argv", ["dspark-serve", "serve", "--backend", "sglang",
                                     "--tp-size", "2"])
    args = served(None)
    assert args.sglang_args == ["--tp-size", "2"] and args.backend == "sglang"


@pytest.mark.parametrize("argv", [
    ["serve", "--tp-size", "2"],                                   # embedded by default
    ["serve", "--backend", "embedded", "--mem-fraction-static", "0.7"],
    ["bench", "scheduler", "--backend", "sglang", "--no-such-flag"],  # other subcommands
])
def test_unknown_flags_rejected_elsewhere(served, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        served(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
