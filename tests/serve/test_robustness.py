"""Loading, disconnects, failures and malformed requests: the server stays up and answers in
OpenAI's error shape."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import openai
import pytest

from oled.decoding.batch import BatchDecoder
from oled.serve.app import create_app
from oled.serve.engine import Engine

MODEL = "tiny-test"
CHAT = "/v1/chat/completions"


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def assert_error(resp: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    if status is not None:
        assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_health_is_503_while_loading(tiny_dir, start_server, loader, until):
    gate = threading.Event()
    app = create_app(Engine(loader(tiny_dir, gate)), model_name=MODEL)
    with start_server(app, wait_healthy=False) as url:
        assert httpx.get(f"{url}/health").status_code == 503
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(f"{url}{CHAT}", json=body).json()["error"]["code"] == "model_not_ready"
        gate.set()
        until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "never became ready")
        ready = httpx.post(f"{url}{CHAT}", json=body | {"max_tokens": 4}, timeout=60)
        assert ready.status_code == 200


def test_client_disconnect_cancels_generation(http, until):
    before = metric(http, 'oled_generations_total{finish_reason="cancelled"}')
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me everything"}],
        "max_tokens": 3000,
        "threshold": 1.0,
        "block_length": 8,
        "stream": True,
    }
    with http.stream("POST", CHAT, json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += '"content":"' in line and '"content":""' not in line
            if seen >= 2:
                break  # leave mid-stream: closing the response drops the connection
    started = time.monotonic()
    until(
        lambda: metric(http, 'oled_generations_total{finish_reason="cancelled"}') > before,
        20,
        "the generation was not cancelled",
    )
    assert time.monotonic() - started < 20
    assert metric(http, "oled_client_disconnects_total") >= 1
    assert http.get("/health").status_code == 200
    quick = http.post(CHAT, json={"model": MODEL, "messages": body["messages"], "max_tokens": 2})
    assert quick.status_code == 200


def test_failure_mid_stream_is_an_sse_error(client, http, monkeypatch):
    real, blocks = BatchDecoder.step, []

    def broken(self):
        if blocks:  # the step after the first finished block
            raise RuntimeError("device lost")
        events = real(self)
        blocks.extend(ev.block for ev in events if ev.block is not None)
        return events

    monkeypatch.setattr(BatchDecoder, "step", broken)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=40,
        stream=True,
        extra_body={"block_length": 4},
    )
    with pytest.raises(openai.APIError, match="device lost"):
        for _ in stream:
            pass
    monkeypatch.undo()
    assert http.get("/health").status_code == 200
    assert metric(http, 'oled_generations_total{finish_reason="error"}') >= 1


def test_errors_have_the_openai_shape(http):
    assert assert_error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert_error(http.post(CHAT, content=b"{", headers={"Content-Type": "application/json"}), 400)
    assert_error(http.post(CHAT, content=b'{"model": "x"}', headers={"Content-Type": "text/plain"}))
    assert_error(httpx.get(str(http.base_url.join("/v1/models"))), 401)
    long = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x " * 3000}],
        "max_tokens": 3000,
    }
    assert assert_error(http.post(CHAT, json=long), 400)["code"] == "context_length_exceeded"
    assert http.get("/health").status_code == 200


def local_port(resp: httpx.Response) -> int:
    """The client's port of the connection that carried `resp`."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def answered_on_the_same_connection(http: httpx.Client, port: int) -> bool:
    after = http.post(
        CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2},
    )
    return after.status_code == 200 and local_port(after) == port


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": "ab", "stop": ["x", "\\udc80"]}', "stop.1"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(http, route, body, param):
    raw = body.replace("{", '{"model": "tiny-test", ', 1).encode()
    resp = http.post(route, content=raw, headers={"Content-Type": "application/json"})
    error = assert_error(resp, 400)
    assert error["param"] == param and error["message"].startswith(f"{param} is not valid UTF-8")
    assert answered_on_the_same_connection(http, local_port(resp))


def test_an_unexpected_error_is_a_500_and_the_connection_stays(engine, http, monkeypatch):
    def broken(*_args):
        raise TypeError("a bug")

    monkeypatch.setattr(engine.runtime.tokenizer, "render_chat", broken)
    resp = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 500 and resp.json()["error"] == {
        "message": "internal error: TypeError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    port = local_port(resp)
    monkeypatch.undo()
    assert answered_on_the_same_connection(http, port)


def malformed_bodies(n: int, seed: int = 0) -> list[tuple[bytes, str]]:
    """Seeded bad requests: wrong types, missing fields, huge numbers, non-JSON, wrong types."""
    rng = random.Random(seed)
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    junk = [
        None,
        True,
        -1,
        0,
        10**30,
        1e308,
        -1e-9,
        "",
        "x" * 50,
        [],
        {},
        [1, "a"],
        {"a": 1},
        float("nan"),
        "NaN",
        2**63,
    ]
    fields = [
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "stream",
        "stream_options",
        "block_length",
        "threshold",
        "seed",
        "stop",
        "n",
        "max_completion_tokens",
    ]
    cases: list[tuple[bytes, str]] = []
    raw = [
        b"",
        b"not json",
        b"[1, 2]",
        b'"text"',
        b"{'model': 1}",
        b"\xff\xfe",
        b"{" * 5000,
        b"null",
        b'{"model": "tiny-test", "messages": [',
        b"1" * 5000,
    ]
    cases += [(r, "application/json") for r in raw]
    cases += [(json.dumps(good).encode(), ct) for ct in ("text/plain", "", "application/xml")]
    while len(cases) < n:
        body = json.loads(json.dumps(good))
        key = rng.choice(fields)
        if rng.random() < 0.2:
            body.pop(rng.choice(["model", "messages"]))
        elif key == "messages":
            body["messages"] = rng.choice(
                [
                    [],
                    [{"role": "robot", "content": "x"}],
                    [{"content": "x"}],
                    [{"role": "user", "content": 5}],
                    ["hi"],
                    [{"role": "user", "content": [{"type": "image"}]}],
                ]
            )
        else:
            value = rng.choice(junk)
            if value == "" and key == "stream":
                value = "yes"
            body[key] = value
        if _valid(body):
            continue
        cases.append((json.dumps(body, allow_nan=True).encode(), "application/json"))
    return cases[:n]


def _valid(body: dict) -> bool:
    """Bodies the seeded generator may produce that are in fact acceptable."""
    from pydantic import ValidationError

    from oled.serve.protocol import ChatCompletionRequest

    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return False
    return req.model == MODEL and (req.wanted_tokens() or 8) <= 4000 and req.seed is None


def test_fuzz_malformed_bodies(http):
    for body, ctype in malformed_bodies(60):
        headers = {"Content-Type": ctype} if ctype else {}
        resp = http.post(CHAT, content=body, headers=headers)
        assert_error(resp)
        resp = http.post("/v1/completions", content=body, headers=headers)
        assert_error(resp)
    assert http.get("/health").status_code == 200


def test_cli_serve_streams_to_the_openai_client(tiny_dir, tmp_path, start_cli):
    args = [
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--served-model-name",
        "tiny",
        "--block-length",
        "8",
    ]
    with start_cli(tmp_path / "serve.log", *args) as (url, _proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=60)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
