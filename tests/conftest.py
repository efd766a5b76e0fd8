"""Suite-wide settings (applied before any test module imports torch) and the in-process
server starter shared by the server and reliability tests."""
import contextlib
import os
import socket
import threading
import time

import pytest

# Tests run live servers beside the test process on a 2-core machine; OpenMP's default
# spin-waiting barriers make every multi-threaded step 5-30x slower when cores are shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@contextlib.contextmanager
def _serve(engine, startup_timeout: float = 60.0):
    """Run ``create_app(engine)`` under uvicorn in a thread on a free loopback port; yields
    (base_url, app). Raises RuntimeError if the server does not start in time."""
    import uvicorn

    from dspark_serve.server.app import create_app

    app = create_app(engine)
    # proto IPPROTO_TCP makes asyncio set TCP_NODELAY on accepted connections; without it
    # Nagle + delayed ACK add 40 ms to every keep-alive request
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def serve_engine():
    """``serve_engine(engine)``: context manager serving an engine, yields (base_url, app)."""
    return _serve
