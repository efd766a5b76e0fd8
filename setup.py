"""Build script for dspark-serve.

The CUDA extension in ``csrc/`` is compiled when a CUDA toolkit and a CUDA build of
torch are present (``DSPARK_BUILD_CUDA=1`` forces it, ``=0`` skips it).
"""
from setuptools import find_packages, setup

setup(
    name="dspark-serve",
    version="0.1.0",
    description="DSpark speculative decoding, served: drafter, calibration, hardware-aware scheduling, lossless verification",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["dspark_serve*", "profiler*", "loadtest*"]),
    include_package_data=True,
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
    ],
    extras_require={
        "test": ["pytest", "scipy", "openai", "httpx"],
    },
    entry_points={"console_scripts": ["dspark-serve=dspark_serve.cli:main"]},
)
