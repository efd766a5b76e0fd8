"""Stock SGLang servers on the CPU for the end-to-end tests (``test_e2e_cpu.py``).

``cpu_server(name, *args, ragged_mode=...)`` starts ``python -m sglang.launch_server`` with the
default model in fp32 on the CPU engine, with ``cpu_harness/site`` first on its PYTHONPATH
(the ``sgl_kernel`` stand-in and the test-only harness plugin; see
``cpu_harness/site/dspark_sglang_cpu_harness``). One torch thread: on two shared cores more
threads fight sglang's busy-polling scheduler threads (9x slower decoding measured).
Needs nothing from sglang at import, so collecting this directory without sglang works.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS_SITE = Path(__file__).resolve().parent / "cpu_harness" / "site"
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


class CpuServer:
    """A running SGLang server process (its own process group) and its log file."""

    def __init__(self, name: str, process: subprocess.Popen, port: int, log: Path,
                 started_in_s: float):
        self.name = name
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.started_in_s = started_in_s

    def alive(self) -> bool:
        """True while the server process has not exited."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log, skipping sglang's model-import noise."""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join([t for t in text if "Ignore import error" not in t][-lines:])

    def generate(self, input_ids: list[int], **sampling_params) -> dict:
        """POST /generate for one prompt; the reply JSON (``output_ids``, ``meta_info``).
        Raises AssertionError with the log tail on an HTTP error or a dead server."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params}
        request = urllib.request.Request(f"{self.url}/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                assert reply.status == 200
                return json.load(reply)
        except (urllib.error.URLError, ConnectionError) as error:
            raise AssertionError(f"{self.name}: /generate failed ({error}); server "
                                 f"{'alive' if self.alive() else 'exited'}; log:\n"
                                 f"{self.log_tail()}") from error

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 20 s."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(20)
        with contextlib.suppress(ProcessLookupError):     # children left behind
            os.killpg(self.process.pid, signal.SIGKILL)


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: a port from ``bind(0)`` comes from that
    range, and in the ~20 s before uvicorn binds it an outgoing connection or torch's
    rendezvous may take it (CI: "address already in use")."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.sample(range(20000, max(low, 20100)), 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000..ephemeral range")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="session")
def default_model() -> str:
    """The default target folder (converted once and cached)."""
    from dspark_serve.assets.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def cpu_server(default_model, tmp_path_factory):
    """Context-manager factory: ``with cpu_server(name, *sglang_args, ragged_mode=None)``
    yields a ready ``CpuServer`` and stops it on exit. ``ragged_mode`` sets
    SGLANG_RAGGED_VERIFY_MODE (static / compact)."""
    logs = tmp_path_factory.mktemp("sglang_cpu")

    def launch(name: str, args: tuple[str, ...], env: dict[str, str]) -> CpuServer:
        """Starts the server and waits until /health answers; a port taken before the server
        bound it is retried on another port (twice)."""
        for attempt in range(3):
            port = _free_port()
            command = [sys.executable, "-m", "sglang.launch_server", "--model-path",
                       default_model, "--device", "cpu", "--attention-backend", "torch_native",
                       "--disable-cuda-graph", "--sampling-backend", "pytorch",
                       "--dtype", "float32", "--context-length", "2048",
                       "--max-total-tokens", "4096", "--random-seed", "0",
                       "--host", "127.0.0.1", "--port", str(port), *args]
            log = logs / f"{name}-{attempt}.log"
            begin = time.monotonic()
            with open(log, "w") as out:
                process = subprocess.Popen(command, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            server = CpuServer(name, process, port, log, 0.0)
            while not _healthy(server.url):
                # uvicorn logs the bind error but the process stays up (sglang 0.5.23)
                if "address already in use" in log.read_text(errors="replace"):
                    server.stop()
                    break
                if not server.alive() or time.monotonic() - begin > STARTUP_TIMEOUT_S:
                    server.stop()
                    raise AssertionError(f"SGLang server {name} did not start "
                                         f"(exit code {process.poll()}); log:\n"
                                         f"{server.log_tail()}")
                time.sleep(1)
            else:
                server.started_in_s = time.monotonic() - begin
                print(f"\n[{name}] server up in {server.started_in_s:.0f} s")
                return server
        raise AssertionError(f"SGLang server {name}: port taken on 3 tries; log:\n"
                             f"{server.log_tail()}")

    @contextlib.contextmanager
    def start(name: str, *args: str, ragged_mode: str | None = None):
        path = [str(HARNESS_SITE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(path)}
        env.pop("SGLANG_RAGGED_VERIFY_MODE", None)
        if ragged_mode is not None:
            env["SGLANG_RAGGED_VERIFY_MODE"] = ragged_mode
        server = launch(name, args, env)
        try:
            yield server
        finally:
            server.stop()

    return start
