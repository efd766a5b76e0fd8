"""A fresh ``dspark-serve serve`` subprocess (or another OpenAI server, e.g. llama.cpp's) on a
free loopback port: start, wait until healthy, warm up, stop. Loopback only: the sweep never binds or talks beyond 127.0.0.1."""
from __future__ import annotations

import ipaddress
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK = "127.0.0.1"
DEFAULT_SERVER_CMD = (sys.executable, "-m", "dspark_serve.cli")
WARMUP_PROMPT = "Write one sentence about the sea."


def is_loopback(url: str) -> bool:
    """Whether every address the host of ``url`` resolves to is a loopback address
    (an unresolvable or missing host is not)."""
    host = urlparse(url).hostname
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server process exited or never became healthy."""


class ManagedServer:
    """``server_cmd [subcommand] <args> --host 127.0.0.1 --port P`` as a child process (own
    session, so a Ctrl-C of the sweep reaches it only through ``stop``), logging to
    ``log_path``; healthy once ``health_path`` answers 200.

    Use as a context manager: entering starts it and waits for /health (raising
    ``ServerError`` with the log tail), leaving stops it.
    """

    def __init__(self, args: list[str], log_path: Path, *,
                 server_cmd: tuple[str, ...] | list[str] = DEFAULT_SERVER_CMD,
                 startup_timeout_s: float = 300.0, subcommand: str | None = "serve",
                 health_path: str = "/health"):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.cmd = [*server_cmd, *([subcommand] if subcommand else []), *args,
                    "--host", LOOPBACK, "--port", str(self.port)]
        self.health_path = health_path
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "ManagedServer":
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._log.write("$ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.startup_s = self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self) -> float:
        """Poll the health path until 200; returns seconds waited. Raises ServerError if the process
        exits or the startup timeout passes."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (OSError, urllib.error.HTTPError):
                pass
            if time.monotonic() - start > self.startup_timeout_s:
                raise ServerError(f"no healthy /health within {self.startup_timeout_s:.0f} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.25)

    def warm_up(self, requests: int, max_tokens: int = 4, timeout_s: float = 120.0) -> int:
        """Send ``requests`` concurrent short chat completions (lazy initialisation, caches,
        the scheduler's history); returns how many succeeded."""
        body = json.dumps({"model": "default", "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": WARMUP_PROMPT}]}).encode()

        def one(_):
            req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    return resp.status == 200
            except OSError:
                return False

        with ThreadPoolExecutor(max_workers=requests) as pool:
            return sum(pool.map(one, range(requests)))

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after ``grace_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
