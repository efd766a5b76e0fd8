"""The CUDA extension compiles, links against this torch and registers its ops (issue 7: CI
compiles the extension and fails if it does not compile). Runs wherever nvcc and a CUDA
build of torch exist, GPU or not; uses an already built ``dspark_serve._C`` when there is
one, else builds for sm_90 (``DSPARK_CUDA_ARCHS`` overrides) into build/test-extension,
which keeps reruns incremental. A cold build takes ~3 min on 2 cores."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = [
    "dspark::philox_uniforms(Tensor seed, Tensor offset, Tensor(a!) out) -> ()",
    "dspark::markov_sample(Tensor base_logits, Tensor hidden, Tensor w1, Tensor w2, "
    "Tensor? conf_weight, Tensor? conf_bias, Tensor anchor, Tensor temperature, Tensor top_k, "
    "Tensor top_p, Tensor min_p, Tensor uniforms, Tensor(a!) tokens, Tensor(b!) probs, "
    "Tensor(c!) conf_logits, int launch_mode) -> ()",
    "dspark::varlen_attention(Tensor q, Tensor marker, Tensor k_cache, Tensor v_cache, "
    "Tensor page_table, Tensor(a!) out, float scale, int num_splits) -> ()",
]


def _cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        home = "/usr/local/cuda"
    if home is None and shutil.which("nvcc"):
        home = str(Path(shutil.which("nvcc")).resolve().parents[1])
    return home


@pytest.mark.slow
def test_extension_compiles_and_registers_ops(tmp_path):
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build: nothing to compile against")
    cuda_home = _cuda_home()
    if cuda_home is None:
        pytest.skip("no CUDA toolkit (nvcc) found")
    spec = importlib.util.find_spec("dspark_serve._C")
    if spec is not None:
        library = spec.origin
    else:
        env = dict(os.environ, CUDA_HOME=cuda_home, DSPARK_BUILD_CUDA="1",
                   DSPARK_CUDA_ARCHS=os.environ.get("DSPARK_CUDA_ARCHS", "90"))
        build = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path),
             "--build-temp", str(REPO / "build" / "test-extension")],
            cwd=REPO, env=env, capture_output=True, text=True)
        assert build.returncode == 0, \
            f"extension build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
        library = str(next(tmp_path.rglob("_C*.so")))
    # A fresh interpreter: a second library registering TORCH_LIBRARY(dspark) would clash.
    probe = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
             "[print(getattr(torch.ops.dspark, n).default._schema) "
             "for n in ('philox_uniforms', 'markov_sample', 'varlen_attention')]")
    loaded = subprocess.run([sys.executable, "-c", probe, library], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert loaded.stdout.splitlines() == SCHEMAS
