"""Fixtures for the load-test tests: the fake-engine stand-in for ``dspark-serve serve``
(``fake_serve.py``; until the lead points these tests at the real engine)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE_SERVE = Path(__file__).with_name("fake_serve.py")


@pytest.fixture
def fake_server_cmd() -> list[str]:
    """Command that, followed by ``serve <flags>``, starts the fake-engine server."""
    return [sys.executable, str(FAKE_SERVE)]
