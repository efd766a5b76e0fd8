"""``dspark-serve serve`` with the real default model (SmolLM2-135M-Instruct, default DSpark
drafter, async scheduler) in a subprocess on a free loopback port, driven by the official
``openai`` client. A static cost table skips the start-up SPS profile; ``--always-draft``
makes every decode step propose, so the speculation these tests count does not hang on the
scheduler's timing-dependent choice to draft (a loaded host made it decode plainly)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dspark_serve.assets.default_model import MODEL_NAME
from dspark_serve.scheduling.cost_table import CostTable

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    table = tmp_path_factory.mktemp("serve") / "cost_table.json"
    CostTable.from_step_times([1, 8, 32, 64], [0.06, 0.09, 0.19, 0.32]).save(str(table))
    port = _free_port()
    log = (tmp_path_factory.getbasetemp() / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_serve.cli", "serve", "--port", str(port),
         "--cost-table", str(table), "--max-num-seqs", "4", "--max-model-len", "512",
         "--always-draft", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def client(server_url):
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def test_models_list_names_the_default_model(client):
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0.8, seed=11)
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert text.strip()
    assert full.choices[0].finish_reason in ("stop", "length")
    stats = full.model_extra["dspark"]
    assert set(stats) >= {"accepted_length", "verify_rounds", "drafted_tokens", "accepted_tokens"}
    assert stats["verify_rounds"] >= 1 and stats["drafted_tokens"] >= stats["verify_rounds"]
    assert stats["accepted_length"] >= 1.0

    pieces, reasons, streamed_stats = [], [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
        if (chunk.model_extra or {}).get("dspark"):
            streamed_stats.append(chunk.model_extra["dspark"])
    assert "".join(pieces) == text  # seeded: the same tokens whatever the verify rounds
    assert [r for r in reasons if r] == [full.choices[0].finish_reason]
    assert len(streamed_stats) == 1 and streamed_stats[0]["verify_rounds"] >= 1


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_metrics_count_speculation(client, server_url):
    client.completions.create(model=MODEL_NAME, prompt="The rainbow has", max_tokens=8,
                              temperature=0.0)
    text = httpx.get(server_url + "/metrics", timeout=10).text
    rounds = _metric(text, "dspark_verify_rounds_total")
    assert rounds >= 1
    assert _metric(text, "dspark_drafted_tokens_total") >= rounds
    assert _metric(text, "dspark_accepted_tokens_total") >= 0
    assert _metric(text, "dspark_generated_tokens_total") >= 8
    assert _metric(text, "dspark_mean_accepted_length") >= 1.0
    assert re.search(r'^dspark_position_verified_total\{position="1"\} ', text, re.MULTILINE)
