"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from oled.decoding import DecodeConfig
from oled.runtime import load_runtime
from oled.serve.app import create_app
from oled.serve.engine import Engine
from oled.serve.server import DrainingServer

API_KEY = "sk-test-key"
MODEL = "tiny-test"


@contextlib.contextmanager
def running_server(app, *, wait_healthy: bool = True) -> Iterator[str]:
    """Serve `app` on a free port; yields the base URL; always shuts down."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = DrainingServer(config, app.state.server.engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.started, 20, "the server did not start")
        if wait_healthy:
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "not healthy")
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextlib.contextmanager
def cli_server(log_path: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`oled serve ARGS --port FREE` in a child process, logging to `log_path`; yields (URL,
    process) once /health is 200; always ends the process."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "oled.cli", "serve", *args, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(
                lambda: proc.poll() is not None or httpx.get(f"{url}/health").is_success,
                60,
                "the server did not become healthy",
            )
            assert proc.poll() is None, log_path.read_text()
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        time.sleep(0.05)
    raise AssertionError(message)


def tiny_loader(path: Path, gate: threading.Event | None = None):
    def load():
        if gate is not None:
            gate.wait(30)
        decode = DecodeConfig(block_length=8, max_new_tokens=8)
        return load_runtime(str(path), device="cpu", dtype="float32", decode=decode)

    return load


@pytest.fixture(scope="session")
def served(tiny_dir) -> Iterator[tuple[str, Engine]]:
    """One server for the session: the tiny model, bearer key required; (URL, engine)."""
    engine = Engine(tiny_loader(tiny_dir))
    app = create_app(
        engine, model_name=MODEL, default_max_tokens=8, max_tokens=4000, api_key=API_KEY
    )
    with running_server(app) as url:
        yield url, engine


@pytest.fixture()
def server_url(served) -> str:
    return served[0]


@pytest.fixture()
def engine(served) -> Engine:
    return served[1]


@pytest.fixture()
def client(server_url):
    import openai

    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture()
def http(server_url) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server_url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture()
def start_server():
    """`running_server` for tests that need a server of their own."""
    return running_server


@pytest.fixture()
def loader():
    """`tiny_loader(path, gate)` for tests that build their own engine."""
    return tiny_loader


@pytest.fixture()
def start_cli():
    """`cli_server(log_path, *args)` for tests of the `oled serve` command."""
    return cli_server


@pytest.fixture()
def unused_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    return free_port()


@pytest.fixture()
def until():
    """`wait_for(condition, timeout, message)`."""
    return wait_for
