"""Which machine a profile belongs to: the device SKU that names the cost table file
(``NVIDIA_H200``; on CPU the model name plus the cores the profile ran on) and the metadata
stored with it."""
from __future__ import annotations

import datetime
import platform
import re

import torch

_TRADEMARKS = re.compile(r"\((R|TM|tm|r)\)|@\s*[\d.]+\s*GHz|\bCPU\b")


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else ``platform.processor()``/machine."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def sanitize(name: str) -> str:
    """A file-name-safe SKU: trademarks and clock speed dropped, runs of other characters
    collapsed to ``_`` ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", _TRADEMARKS.sub(" ", name)).strip("_") or "unknown"


def device_sku(device: torch.device | str) -> str:
    """SKU of ``device``: the CUDA device name, or the CPU model name plus ``_{n}c`` for the
    n threads torch computes with (CPU step time depends on them)."""
    device = torch.device(device)
    if device.type == "cuda":
        return sanitize(torch.cuda.get_device_name(device))
    return f"{sanitize(cpu_model_name())}_{torch.get_num_threads()}c"


def device_metadata(device: torch.device | str, **extra) -> dict:
    """Cost-table metadata: device name and SKU, torch / CUDA versions, CPU threads, UTC date,
    plus ``extra`` (model, dtype, ...)."""
    device = torch.device(device)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name())
    meta = {"device": name, "device_type": device.type, "sku": device_sku(device),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu_threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    meta.update(extra)
    return meta
