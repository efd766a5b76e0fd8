"""``dspark-serve serve``: flags -> EngineConfig -> LLMEngine -> uvicorn, without a model."""
import sys
import types

import pytest

from dspark_serve import cli
from dspark_serve.engine.config import EngineConfig


@pytest.fixture
def launched(monkeypatch, make_fake_engine):
    """Replace LLMEngine (lazy import) and uvicorn.run; returns what they were called with."""
    calls = {}

    def fake_llm_engine(config):
        calls["config"] = config
        return make_fake_engine()

    module = types.ModuleType("dspark_serve.engine.llm_engine")
    module.LLMEngine = fake_llm_engine
    monkeypatch.setitem(sys.modules, "dspark_serve.engine.llm_engine", module)
    import uvicorn
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.update(app=app, **kw))
    return calls


def test_defaults(launched):
    assert cli.main(["serve"]) == 0
    assert launched["config"] == EngineConfig()
    assert (launched["host"], launched["port"], launched["log_level"]) == ("127.0.0.1", 8000,
                                                                           "info")
    assert launched["app"].state.async_engine.engine.model_name == "fake-model"


def test_all_flags(launched):
    argv = ["serve", "--model", "/m", "--draft", "/d", "--speculative", "dflash", "--scheduler",
            "threshold", "--gamma", "5", "--threshold", "0.7", "--cost-table", "c.json",
            "--calibration", "s.json", "--max-model-len", "4096", "--max-num-seqs", "4",
            "--dtype", "bfloat16", "--quantization", "int4", "--always-draft", "--seed", "3",
            "--no-mask-drafts", "--draft-vocab-size", "8192", "--host", "0.0.0.0", "--port", "9001",
            "--log-level", "debug"]
    assert cli.main(argv) == 0
    assert launched["config"] == EngineConfig(
        model="/m", draft="/d", speculative="dflash", scheduler="threshold", gamma=5,
        threshold=0.7, cost_table="c.json", calibration="s.json", max_model_len=4096,
        max_num_seqs=4, dtype="bfloat16", quantization="int4", always_draft=True, seed=3,
        mask_drafts=False, draft_vocab_size=8192)
    assert (launched["host"], launched["port"], launched["log_level"]) == ("0.0.0.0", 9001, "debug")


def test_invalid_values(launched, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--speculative", "eagle"])
    assert "invalid choice: 'eagle'" in capsys.readouterr().err
    assert cli.main(["serve", "--gamma", "0"]) == 2
    assert "config" not in launched


def test_threads_flag(launched, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert cli.main(["serve", "--threads", "1"]) == 0
    assert calls == [1]
    assert cli.main(["serve", "--threads", "0"]) == 2
    assert calls == [1]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert cli.main(["serve"]) == 0 and calls == [1, 7]  # no flag: a core for the event loop
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert cli.main(["serve"]) == 0 and calls == [1, 7, 8]  # the user's OMP_NUM_THREADS


def test_serving_threads():
    from dspark_serve.server.cli import serving_threads

    assert serving_threads(3, 16) == 3
    assert serving_threads(None, 1) == 1
