"""Stand-in for ``dspark-serve serve`` in load-test tests: accepts the flags the sweep passes
and serves the fake engine of ``tests/server/conftest.py`` (loaded by path, so it is reused, not
copied) under uvicorn. ``--speculative`` and ``--scheduler`` are accepted and ignored: the fake
engine always reports speculative stats (gamma = 4). ``--step-delay`` sets its seconds per step.
"""
from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
from pathlib import Path

import uvicorn

from dspark_serve.server.app import create_app

CONFTEST = Path(__file__).resolve().parents[1] / "server" / "conftest.py"


def load_fake_engine_module():
    spec = importlib.util.spec_from_file_location("_server_conftest", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["serve"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative", default="dspark")
    p.add_argument("--scheduler", default="async")
    p.add_argument("--step-delay", type=float, default=0.005)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    fake = load_fake_engine_module()
    engine = fake.FakeEngine(step_delay=args.step_delay, max_num_seqs=args.max_num_seqs)
    # TCP_NODELAY on accepted sockets, as in the server tests (no 40 ms Nagle stalls)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
