"""The CPU image, built and served for real: ``docker build`` of docker/Dockerfile.cpu, then
``docker run`` with its default command, /health and Docker's own healthcheck, the official
``openai`` client (chat, streamed chat, a rejected request), and the container and image removed.

Needs a Docker daemon (skipped otherwise) and the package registry during the build. Without
an image registry, build a local base first and say where torch comes from (docker/README.md;
.ci/docker does all of this):

    DSPARK_DOCKER_BASE_IMAGE=dspark-local/python:3.11-bookworm \\
    DSPARK_DOCKER_TORCH_SOURCE="--find-links /wheels torch==2.13.0+cpu" \\
    python -m pytest -m docker tests/docker/test_cpu_image.py

``DOCKER`` names the docker CLI to use (default: ``docker`` on PATH).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER", "docker")
IMAGE = "dspark-serve:cpu-test"
DEFAULT_BASE = "python:3.11-slim-bookworm"  # Dockerfile.cpu's default BASE_IMAGE
MODEL = "SmolLM2-135M-Instruct"
BUILD_TIMEOUT_S = 1200
HEALTHY_TIMEOUT_S = 240
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


def report(request, line: str) -> None:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the numbers belong in the CI log
        print(f"\n[docker] {line}", flush=True)


@pytest.fixture(scope="module")
def daemon():
    if shutil.which(DOCKER) is None:
        pytest.skip(f"no docker CLI ({DOCKER}); .ci/docker installs Debian's docker.io")
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("docker info timed out: no Docker daemon reachable")
    if info.returncode != 0:
        pytest.skip(f"no Docker daemon reachable: {info.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def image(daemon, request):
    """Size in bytes of the freshly built image, and of its base image."""
    args = []
    for env, arg in (("DSPARK_DOCKER_BASE_IMAGE", "BASE_IMAGE"),
                     ("DSPARK_DOCKER_TORCH_SOURCE", "TORCH_SOURCE")):
        if os.environ.get(env):
            args += ["--build-arg", f"{arg}={os.environ[env]}"]
    start = time.monotonic()
    proc = subprocess.run([DOCKER, "build", "-f", "docker/Dockerfile.cpu", "-t", IMAGE, *args,
                           "."], cwd=ROOT, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    base = os.environ.get("DSPARK_DOCKER_BASE_IMAGE") or DEFAULT_BASE
    base_size = int(docker("image", "inspect", "-f", "{{.Size}}", base).stdout)
    builder = "BuildKit" if os.environ.get("DOCKER_BUILDKIT") == "1" else "default builder"
    report(request, f"built {IMAGE} in {time.monotonic() - start:.1f} s ({builder}, "
                    f"{' '.join(args) or 'default build args'}): {size / 1e6:.0f} MB, "
                    f"base {base} {base_size / 1e6:.0f} MB")
    image_id = docker("image", "inspect", "-f", "{{.Id}}", IMAGE).stdout.strip()
    yield size, base_size
    # ~3 GB per build, left behind by every run until the disk filled; by id, because removing
    # the tag of a BuildKit image only untags it
    docker("rmi", "-f", image_id, timeout=120)
    assert docker("image", "inspect", image_id, check=False).returncode != 0


def test_image_contents(image):
    """Only the base, the venv and the converted model: no VOLUME (that would make a ~540 MB
    anonymous volume per `docker run`), no model wheel, no source tree, a non-root owner."""
    size, base_size = image
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", IMAGE).stdout)
    assert not config.get("Volumes")
    assert config["User"] == "10001:10001"
    drafters = f"/opt/venv/lib/python3.11/site-packages/dspark_serve/assets/drafters/{MODEL}"
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "sh", IMAGE, "-c",
                 f"ls /cache; ls /cache/models; ls {drafters}; "
                 f"stat -c %u /cache/models/{MODEL}-v1; ls -d /src /opt/dspark-serve /wheels; "
                 "for d in /opt/venv /cache; do find $d -type f -printf '%s\\n' | "
                 "awk '{s += $1} END {printf \"%.0f\\n\", s}'; done").stdout.split()
    # every drafter kind the package ships (dflash, dspark, ngram ...), as in the source tree
    kinds = sorted(p.name for p in (ROOT / "dspark_serve/assets/drafters" / MODEL).iterdir()
                   if p.is_dir())
    n = 2 + len(kinds)
    assert out[:n + 1] == ["models", f"{MODEL}-v1", *kinds, "10001"], out
    assert len(out) == n + 3, out  # ls -d printed nothing: none of those exists
    venv, cache = map(int, out[n + 1:])  # bytes in files
    # the runtime stage adds nothing else but the user's home and passwd entries
    assert 0 <= size - base_size - venv - cache < 1e6, (size, base_size, venv, cache)


@pytest.fixture(scope="module")
def server(image, request):
    """(container name, base url) of the image running its default command."""
    name = f"dspark-test-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    docker("run", "-d", "--name", name, "-p", "127.0.0.1::8000", IMAGE)
    try:
        port = docker("port", name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        while True:
            state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
            if not state["Running"]:
                pytest.fail(f"container exited with {state['ExitCode']}:\n"
                            + docker("logs", name, check=False).stderr[-4000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - start > HEALTHY_TIMEOUT_S:
                pytest.fail(f"not healthy after {HEALTHY_TIMEOUT_S} s:\n"
                            + docker("logs", name, check=False).stderr[-4000:])
            time.sleep(0.5)
        report(request, f"/health answered 200 {time.monotonic() - start:.1f} s after "
                        "docker run")
        yield name, url
    finally:
        docker("rm", "-f", name, check=False)
        assert name not in docker("ps", "-a", "--format", "{{.Names}}").stdout.split()


def test_serves_openai_api(server, request):
    name, url = server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.8, seed=11)
        start = time.monotonic()
        full = client.chat.completions.create(**kwargs)
        report(request, f"chat request answered in {time.monotonic() - start:.2f} s")
        text = full.choices[0].message.content
        assert text.strip() and full.choices[0].finish_reason in ("stop", "length")
        # whether a step drafts depends on the cost table profiled at start; the counts agree
        stats = full.model_extra["dspark"]
        rounds, drafted, accepted = (stats["verify_rounds"], stats["drafted_tokens"],
                                     stats["accepted_tokens"])
        assert set(stats) == {"accepted_length", "verify_rounds", "drafted_tokens",
                              "accepted_tokens"}
        assert 0 <= accepted <= drafted and drafted >= rounds
        assert stats["accepted_length"] == pytest.approx((accepted + rounds) / rounds
                                                         if rounds else 0.0)

        pieces, streamed_stats = [], []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            pieces += [c.delta.content or "" for c in chunk.choices]
            if (chunk.model_extra or {}).get("dspark"):
                streamed_stats.append(chunk.model_extra["dspark"])
        assert "".join(pieces) == text  # seeded: the same tokens whatever the verify rounds
        assert len(streamed_stats) == 1 and set(streamed_stats[0]) == set(stats)

        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
        assert info.value.status_code == 400 and info.value.body["param"] == "temperature"

    logs = docker("logs", name).stderr
    assert "downloading" not in logs and "converting" not in logs  # the model came baked in
    # Docker's HEALTHCHECK (python from the venv, every 15 s) agrees with /health
    deadline = time.monotonic() + 60
    while (status := docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()) \
            == "starting" and time.monotonic() < deadline:
        time.sleep(1)
    assert status == "healthy"
