"""The bounded queue behind a full batch (`--max-queue`): a request beyond it is answered at
once with a 429 and Retry-After; a stream that waits receives SSE keep-alive comments, which the
openai client skips; a request that waits, streamed or not, is answered once a place frees."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI

from oled.serve.app import create_app
from oled.serve.engine import Engine

MODEL = "tiny"
KEEPALIVE_S = 0.2
HOLD = {  # decodes one token a forward for thousands of forwards: it holds the batch
    "model": MODEL,
    "prompt": "And the LORD said",
    "max_tokens": 3000,
    "threshold": 1.0,
    "block_length": 8,
    "stream": True,
}
SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}


@contextlib.contextmanager
def holding_the_batch(url: str) -> Iterator[None]:
    """A long stream that is being decoded until the block ends (its client leaves)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=HOLD, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it decodes
        yield


def queue_depth(url: str) -> float:
    found = re.search(r"^oled_queue_depth (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert found, "no oled_queue_depth in /metrics"
    return float(found.group(1))


def one_queued_app(loader: Callable, tiny_dir: Path) -> FastAPI:
    """One request decodes at a time and one more may wait; keep-alives every 0.2 s."""
    engine = Engine(loader(tiny_dir), max_batch=1, max_queue=1)
    return create_app(engine, model_name=MODEL, max_tokens=4000, keepalive_s=KEEPALIVE_S)


def test_a_request_beyond_the_queue_is_a_429_with_retry_after(
    tiny_dir, loader, start_server, until
):
    with start_server(one_queued_app(loader, tiny_dir)) as url:
        answers: list[httpx.Response] = []
        with holding_the_batch(url):
            waiting = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60)
                )
            )
            waiting.start()
            until(lambda: queue_depth(url) == 1, 30, "the second request did not queue")
            t0 = time.monotonic()
            refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60)
            took = time.monotonic() - t0
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            with pytest.raises(openai.RateLimitError) as seen:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, stream=True)
            assert queue_depth(url) == 1  # the refused ones did not queue
        waiting.join(60)
        metrics = httpx.get(f"{url}/metrics").text
    assert took < 1.0, f"the refusal took {took:.2f} s"
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "rate_limit_error",
        "queue_full",
        None,
    )
    assert "busy" in error["message"]
    assert seen.value.code == "queue_full"
    assert int(seen.value.response.headers["retry-after"]) >= 1
    [answer] = answers  # the one that waited is answered once the batch's place frees
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"]
    assert 'oled_http_requests_total{route="/v1/completions",status="429"} 2.0' in metrics


def test_a_waiting_stream_receives_keep_alive_comments(tiny_dir, loader, start_server, until):
    """Raw lines: comments while it waits, then its chunks and `[DONE]`; the openai client
    parses the same stream to the same text."""
    raw: list[tuple[float, str]] = []

    def read_raw(url: str) -> None:
        body = SHORT | {"stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                raw.append((time.monotonic(), line))

    with start_server(one_queued_app(loader, tiny_dir)) as url:
        with holding_the_batch(url):
            reader = threading.Thread(target=read_raw, args=(url,))
            reader.start()
            until(lambda: queue_depth(url) == 1, 30, "the stream did not queue")
            until(lambda: len(raw) >= 8, 30, "no keep-alive comments came")
            waited = list(raw)
        reader.join(60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=60, max_retries=0)
        parsed: list[str] = []
        with holding_the_batch(url):
            stream = client.completions.create(**SHORT, stream=True)
            until(lambda: queue_depth(url) == 1, 30, "the openai stream did not queue")
            time.sleep(5 * KEEPALIVE_S)  # it receives comments now
        for chunk in stream:
            parsed.append(chunk.choices[0].text if chunk.choices else "")
    comments = [(t, line) for t, line in waited if line]
    assert comments and all(line == ": keep-alive" for _, line in comments), waited
    gaps = [b - a for (a, _), (b, _) in zip(comments, comments[1:], strict=False)]
    assert max(gaps) < 10 * KEEPALIVE_S, gaps
    data = [line.removeprefix("data: ") for _, line in raw if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) >= 2
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert "".join(parsed) == text


def test_a_waiting_request_that_is_not_streamed_is_answered(tiny_dir, loader, start_server, until):
    """It waits many keep-alive periods (its connection sends nothing) and still gets its
    answer, the one it gets alone."""
    with start_server(one_queued_app(loader, tiny_dir)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=60, max_retries=0)
        alone = client.completions.create(**SHORT)
        answers: list[openai.types.Completion] = []
        with holding_the_batch(url):
            waiting = threading.Thread(
                target=lambda: answers.append(client.completions.create(**SHORT))
            )
            waiting.start()
            until(lambda: queue_depth(url) == 1, 30, "the request did not queue")
            time.sleep(10 * KEEPALIVE_S)
            assert waiting.is_alive() and not answers
        waiting.join(60)
    [answer] = answers
    assert answer.choices[0].text == alone.choices[0].text


def test_max_queue_flag_reaches_the_server(tiny_dir, tmp_path, start_cli, until):
    """`--max-queue 0`: no request waits; one that arrives while the batch is full is a 429."""
    args = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32"]
    args += ["--served-model-name", MODEL]
    with start_cli(tmp_path / "serve.log", *args, "--max-batch", "1", "--max-queue", "0") as (
        url,
        _,
    ):
        with holding_the_batch(url):
            refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60)
        until(
            lambda: httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60).status_code == 200,
            30,
            "the batch's place did not free",
        )
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"


def test_a_negative_max_queue_fails_before_loading(unused_port):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "CUDA_VISIBLE_DEVICES": ""}
    cmd = ["serve", "--max-queue", "-1", "--port", str(unused_port)]
    out = subprocess.run(
        [sys.executable, "-m", "oled.cli", *cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "error: --max-queue: Input should be greater than or equal to 0\n"
