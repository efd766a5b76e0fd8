"""Cache root resolution and reading members of cached wheels (no registry access needed)."""
from __future__ import annotations

import zipfile

import pytest

from dspark_serve.data.wheels import cache_dir, wheel_member


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("DSPARK_SERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dspark-serve"
    monkeypatch.setenv("DSPARK_SERVE_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"
    assert cache_dir().is_dir()


def test_member_of_cached_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SERVE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "some_pkg-1.2-py3-none-any.whl", "w") as zf:
        zf.writestr("some_pkg/data/x.txt", "hello")
    assert wheel_member("some-pkg", "1.2", "some_pkg/data/x.txt") == b"hello"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        wheel_member("some-pkg", "1.2", "some_pkg/nope.txt")
