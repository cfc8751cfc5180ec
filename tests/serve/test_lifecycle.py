"""Starting and stopping: `oled serve` on a machine without the device it asks for or on a port
in use, Ctrl+C while the model loads, and shutting down (SIGTERM to the command, or the server
told to exit) with requests open."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from oled.serve.app import create_app
from oled.serve.engine import Engine

MODEL = "tiny"
STREAMS = 4
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me everything"}],
    "max_tokens": 3000,
    "threshold": 1.0,
    "block_length": 8,
}


def oled(*args: str) -> subprocess.CompletedProcess:
    """`oled ARGS` in a child process that sees no CUDA device."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "oled.cli", *args],
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
    )


def test_serve_on_a_missing_cuda_device_fails_like_generate(tiny_dir, unused_port):
    """At once, with generate's one line and exit code, never listening."""
    port = str(unused_port)
    served = oled("serve", "--model", str(tiny_dir), "--device", "cuda", "--port", port)
    generated = oled("generate", "hi", "--model", str(tiny_dir), "--device", "cuda")
    assert generated.returncode == 2 and generated.stderr.count("\n") == 1, generated.stderr
    assert (served.returncode, served.stderr, served.stdout) == (2, generated.stderr, "")


def test_serve_on_a_port_in_use_fails_with_one_line(tiny_dir):
    """Exit code 2 and one line naming the host and the port, before anything loads (no
    server log, no abort from a thread still loading the model)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        served = oled("serve", "--model", str(tiny_dir), "--port", str(port))
    want = f"error: port {port} on 127.0.0.1 is already in use (--port picks another)\n"
    assert (served.returncode, served.stderr, served.stdout) == (2, want, "")


def test_ctrl_c_while_the_model_loads_exits_cleanly(tiny_dir, unused_port):
    """The loading thread is inside torch: the process must end without the interpreter's
    finalization aborting (`terminate called without an active exception`, status -6)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "CUDA_VISIBLE_DEVICES": ""}
    url = f"http://127.0.0.1:{unused_port}"
    cmd = [sys.executable, "-m", "oled.cli", "serve", "--model", str(tiny_dir)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(unused_port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "startup complete" in line:
                break
        health = httpx.get(f"{url}/health", timeout=10).json()
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(30)
    finally:
        proc.kill()
    if health["status"] != "loading":
        pytest.skip("the model loaded before Ctrl+C could reach the loading thread")
    assert "terminate called" not in rest and proc.returncode == 0, (proc.returncode, rest)


def read_stream(url: str, lines: list[str]) -> None:
    """One chat stream's `data:` lines, appended as they come (a dropped connection is kept as
    the last line)."""
    try:
        body = LONG | {"stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
    except httpx.HTTPError as err:
        lines.append(f"dropped: {err!r}")


def test_sigterm_ends_every_open_stream_well_formed(tiny_dir, tmp_path, start_cli, until):
    log = tmp_path / "serve.log"
    args = [
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--served-model-name",
        MODEL,
        "--max-batch",
        "1",
    ]
    with start_cli(log, *args) as (url, proc):
        streams: list[list[str]] = [[] for _ in range(STREAMS)]
        threads = [threading.Thread(target=read_stream, args=(url, s)) for s in streams]
        for thread in threads:
            thread.start()
        until(lambda: all(streams) and any(len(s) > 1 for s in streams), 60, "no stream began")
        decoding = sum(len(s) > 1 for s in streams)  # the others wait in the queue
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(30)
        took = time.monotonic() - sent
        for thread in threads:
            thread.join(30)
    assert decoding == 1
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-2:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["message"], error
    text = log.read_text()
    assert not any(word in text for word in ("Traceback", "ERROR", "CancelledError")), text
    assert took < 2.0, f"exit took {took:.2f} s"


def test_stopping_the_server_answers_every_open_request(tiny_dir, loader, start_server, until):
    """A stream being decoded ends with an error event (the openai client raises it, not a
    connection error); a request waiting in the queue (one at a time) gets a 503 in OpenAI's
    shape."""
    app = create_app(Engine(loader(tiny_dir), max_batch=1), model_name=MODEL)
    raised: list[BaseException] = []
    answers: list[httpx.Response] = []

    def stream(url: str) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        try:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=LONG["messages"],
                max_tokens=LONG["max_tokens"],
                extra_body={"threshold": 1.0, "block_length": 8},
                stream=True,
            )
            for _ in chunks:
                began.set()
        except openai.APIError as err:
            raised.append(err)
        finally:
            began.set()

    began = threading.Event()
    with start_server(app) as url:
        threads = [
            threading.Thread(target=stream, args=(url,)),
            threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{url}/v1/chat/completions", json=LONG, timeout=60)
                )
            ),
        ]
        threads[0].start()
        assert began.wait(60)
        threads[1].start()
        until(
            lambda: re.search(r"^oled_queue_depth 1\.0$", httpx.get(f"{url}/metrics").text, re.M),
            30,
            "the second request was not queued",
        )
    for thread in threads:
        thread.join(30)
    [err] = raised
    assert not isinstance(err, openai.APIConnectionError) and err.code == "server_shutting_down"
    [answer] = answers
    assert answer.status_code == 503 and answer.json()["error"] == {
        "message": "the server is shutting down",
        "type": "service_unavailable",
        "param": None,
        "code": "server_shutting_down",
    }
