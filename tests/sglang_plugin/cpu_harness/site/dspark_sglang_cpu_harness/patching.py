"""Guarded monkeypatching: every patch names the sglang version it was written against and
checks that its target still looks as it did then, or stops the server with a clear error."""
from __future__ import annotations

import inspect
from importlib.metadata import version

SGLANG_VERSION = "0.5.23"


class TargetMoved(RuntimeError):
    """A patch target is missing or its code changed since the version the patch targets."""


def check_sglang_version() -> None:
    """Raise ``TargetMoved`` unless the installed sglang is the one the patches target."""
    installed = version("sglang")
    if installed != SGLANG_VERSION:
        raise TargetMoved(f"the harness patches sglang {SGLANG_VERSION}, installed is "
                          f"{installed}: re-check every patch target and update it")


def checked_target(owner, name: str, anchors: tuple[str, ...] = ()):
    """``getattr(owner, name)`` after checking it exists and that its source contains every
    anchor (the code the patch relies on). Raises ``TargetMoved`` naming what changed."""
    where = _dotted_name(owner)
    target = getattr(owner, name, None)
    if target is None:
        raise TargetMoved(f"{where}.{name} is gone (patch written against sglang "
                          f"{SGLANG_VERSION})")
    if anchors:
        source = inspect.getsource(target)
        missing = [anchor for anchor in anchors if anchor not in source]
        if missing:
            raise TargetMoved(f"{where}.{name} changed since sglang {SGLANG_VERSION}: no "
                              f"longer contains {missing}")
    return target


def _dotted_name(owner) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    if inspect.isclass(owner):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<{type(owner).__qualname__} object>"


def replace(owner, name: str, make, anchors: tuple[str, ...] = ()) -> None:
    """``owner.name = make(original)`` once per process (``checked_target`` first)."""
    original = checked_target(owner, name, anchors)
    if getattr(original, "_dspark_cpu_harness", False):
        return
    patched = make(original)
    patched._dspark_cpu_harness = True
    setattr(owner, name, patched)
