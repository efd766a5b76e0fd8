import json
import multiprocessing
import os
import time

import pytest

from dspark_serve.assets import default_model


def _fake_convert(final):
    """Stands in for the 60 s conversion: logs the call, then publishes a folder atomically
    after a pause long enough for a second caller to arrive."""
    with open(os.path.join(os.environ["DSPARK_SERVE_CACHE"], "conversions.log"), "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    work = final.parent / ".work"
    work.mkdir()
    (work / "config.json").write_text("{}")
    (work / "model.safetensors").write_bytes(b"x")
    os.rename(work, final)


def _call(queue):
    queue.put(default_model.default_model_path())


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_convert", _fake_convert)
    ctx = multiprocessing.get_context("fork")  # children inherit the patched converter
    queue = ctx.Queue()
    procs = [ctx.Process(target=_call, args=(queue,)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = str(tmp_path / "models" / f"{default_model.MODEL_NAME}-{default_model._FORMAT}")
    assert results == [expected] * 3
    assert len((tmp_path / "conversions.log").read_text().split()) == 1
    # A later call finds the folder without converting again.
    assert default_model.default_model_path() == expected
    assert len((tmp_path / "conversions.log").read_text().split()) == 1


@pytest.mark.slow
def test_default_model_folder_is_a_chatml_llama():
    from transformers import AutoTokenizer

    path = default_model.default_model_path()  # converts on first use
    start = time.perf_counter()
    assert default_model.default_model_path() == path
    assert time.perf_counter() - start < 1.0
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 2+2?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config["eos_token_id"] == 2
    ids = tok.encode("Hello world, héllo!")
    assert tok.decode(ids) == "Hello world, héllo!"
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
