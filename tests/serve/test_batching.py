"""Concurrent requests decoded together (`--max-batch`): each answer is the one the request
gets alone, the requests share forwards, and one that leaves frees its slot for the next."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from oled.decoding.batch import BatchDecoder
from oled.offload.budget import Budget
from oled.runtime import Runtime, build_runtime, load_runtime
from oled.serve.app import create_app
from oled.serve.engine import Engine
from tests.serve.conftest import running_server

MODEL = "batched"
WAIT_S = 120
ALONE: dict[str, tuple[str, str, int]] = {}  # answers of requests decoded alone, by repr


@dataclass
class Ask:
    """One request: a chat (a list of messages) or a completion (a string prompt)."""

    prompt: str | list[dict[str, str]]
    max_tokens: int
    stream: bool = False
    stop: list[str] | None = None
    extra: dict = field(default_factory=dict)

    def send(self, client: openai.OpenAI) -> tuple[str, str, int | None]:
        """(text, finish reason, completion tokens or None when streamed)."""
        args = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "stop": self.stop,
            "extra_body": self.extra or None,
        }
        if isinstance(self.prompt, str):
            out = client.completions.create(prompt=self.prompt, **args)
            if self.stream:
                return texts(out, lambda c: c.choices[0].text)
            return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
        out = client.chat.completions.create(messages=self.prompt, **args)
        if self.stream:
            return texts(out, lambda c: c.choices[0].delta.content)
        choice = out.choices[0]
        return choice.message.content, choice.finish_reason, out.usage.completion_tokens


def texts(chunks, text_of: Callable) -> tuple[str, str, None]:
    parts, reason = [], ""
    for c in chunks:
        if c.choices:
            parts.append(text_of(c) or "")
            reason = c.choices[0].finish_reason or reason
    return "".join(parts), reason, None


def alone(rt: Runtime, ask: Ask) -> tuple[str, str, int]:
    """What `ask` gets decoded on its own with `Runtime.stream`: (text, finish, tokens)."""
    key = repr(ask)
    if key not in ALONE:
        ALONE[key] = decode_alone(rt, ask)
    return ALONE[key]


def decode_alone(rt: Runtime, ask: Ask) -> tuple[str, str, int]:
    ids = rt.prompt_ids(ask.prompt, chat=not isinstance(ask.prompt, str))
    cfg = replace(rt.decode, max_new_tokens=ask.max_tokens, **ask.extra)
    tokens = [t for block in rt.stream(ids, decode=cfg) for t in block.new_tokens]
    text = rt.tokenizer.decode(tokens)
    cuts = [i for s in ask.stop or [] if (i := text.find(s)) >= 0]
    if cuts:
        return text[: min(cuts)], "stop", -1
    return text, rt.last_stats.stopped, len(tokens)


def load() -> Runtime:
    """The trained default model in float32 (in bfloat16 a long batched generation can part
    from the single one: the batch attends over a padded number of keys)."""
    return load_runtime(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference() -> Runtime:
    """The same model, loaded apart from the server's."""
    return load()


@pytest.fixture(scope="module")
def batched() -> Iterator[tuple[openai.OpenAI, Engine]]:
    """A server of the trained default model that decodes up to 4 requests together."""
    engine = Engine(load, max_batch=4)
    app = create_app(engine, model_name=MODEL, default_max_tokens=32, max_tokens=4000)
    with running_server(app) as url:
        yield (
            openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=WAIT_S, max_retries=0),
            engine,
        )


class Requests:
    """Requests sent from threads; their answers (or errors) by index."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.answers: dict[int, tuple[str, str, int | None]] = {}
        self.errors: dict[int, BaseException] = {}
        self.ended: dict[int, float] = {}  # time.monotonic() at each end
        self.threads: list[threading.Thread] = []

    def start(self, i: int, ask: Ask) -> None:
        def run() -> None:
            try:
                self.answers[i] = ask.send(self.client)
            except BaseException as err:  # noqa: BLE001 - checked by the test
                self.errors[i] = err
            self.ended[i] = time.monotonic()

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in self.threads), "a request never ended"


def metric(engine: Engine, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def wait(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Whether `condition` came true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def cancelled(engine: Engine) -> float:
    return metric(engine, "oled_generations_total", finish_reason="cancelled")


def shared_forwards(engine: Engine) -> float:
    """Forwards so far that decoded more than one request."""
    one = metric(engine, "oled_batch_size_bucket", le="1.0")
    return metric(engine, "oled_batch_size_count") - one


def first_piece(client: openai.OpenAI, ask: Ask, began: threading.Event, out: list) -> None:
    """Stream `ask`, set `began` at its first text, collect the text in `out`."""
    chunks = client.completions.create(
        model=MODEL,
        prompt=ask.prompt,
        max_tokens=ask.max_tokens,
        stream=True,
        extra_body=ask.extra or None,
    )
    for c in chunks:
        if c.choices and c.choices[0].text:
            out.append(c.choices[0].text)
            began.set()
    began.set()


HELLO = [{"role": "user", "content": "Hello"}]
ASKS = [
    Ask(HELLO, 64, stream=True),
    Ask(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}],
        100,
    ),
    Ask("First Citizen:\nBefore we proceed any further, hear me speak.", 48),
    Ask("KING HENRY:\nNow", 64, stream=True, stop=["\n\n"]),
    Ask([{"role": "user", "content": "Tell me about the king."}], 20, stream=True),
    Ask("JULIET: " * 30, 40),
    Ask("ROMEO:", 48, stream=True, extra={"threshold": 0.5}),
]
LONG = Ask("ROMEO:", 128, stream=True, extra={"threshold": 1.0})  # a token per forward


def test_concurrent_answers_equal_single_answers(batched, reference):
    client, engine = batched
    shared_before = shared_forwards(engine)
    expected = [alone(reference, ask) for ask in [*ASKS, LONG]]
    requests = Requests(client)
    began, long_text = threading.Event(), []
    runner = threading.Thread(target=first_piece, args=(client, LONG, began, long_text))
    runner.start()
    assert began.wait(WAIT_S)
    for i, ask in enumerate(ASKS[:4]):  # while LONG runs
        requests.start(i, ask)
    time.sleep(0.2)
    for i, ask in enumerate(ASKS[4:], 4):  # while those run (or wait for a slot)
        requests.start(i, ask)
    requests.join()
    runner.join(WAIT_S)
    assert not requests.errors
    for i, ask in enumerate(ASKS):
        text, finish, tokens = requests.answers[i]
        want_text, want_finish, want_tokens = expected[i]
        assert (text, finish) == (want_text, want_finish), (i, ask)
        assert tokens is None or want_tokens < 0 or tokens == want_tokens, i
    assert "".join(long_text) == expected[-1][0]
    assert expected[3][1] == "stop" and expected[0][1] == "stop"  # both kinds of stop ran
    assert shared_forwards(engine) > shared_before  # some forwards decoded several of them
    forwards = metric(engine, "oled_batch_size_count")
    assert metric(engine, "oled_batch_size_bucket", le="4.0") == forwards  # never more than 4
    assert wait(lambda: metric(engine, "oled_batch_requests") == 0), "the batch did not empty"


def test_another_block_length_waits_for_the_batch(batched, reference):
    client, engine = batched
    asks = [
        replace(LONG, max_tokens=64),
        Ask(HELLO, 24, extra={"block_length": 8}),
        Ask("ROMEO:", 24),
    ]
    expected = [alone(reference, ask) for ask in asks]
    requests = Requests(client)
    for i, ask in enumerate(asks):
        requests.start(i, ask)
        time.sleep(0.1)
    requests.join()
    assert not requests.errors
    assert [requests.answers[i][:2] for i in range(3)] == [e[:2] for e in expected]


def test_a_client_that_leaves_frees_its_slot(reference):
    """Two slots: A and B decode, C waits; A's client leaves, C takes its slot and finishes
    (long before B), and B's answer is still its own."""
    engine = Engine(load, max_batch=2)
    app = create_app(engine, model_name=MODEL, max_tokens=4000)
    a, b, c = Ask("ROMEO:", 3000, extra={"threshold": 1.0}), LONG, Ask(HELLO, 32)
    expected = {"B": alone(reference, b), "C": alone(reference, c)}
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=WAIT_S, max_retries=0)
        left = cancelled(engine)
        requests = Requests(client)
        stream = client.completions.create(
            model=MODEL, prompt=a.prompt, max_tokens=a.max_tokens, stream=True, extra_body=a.extra
        )
        chunks = iter(stream)
        next(chunks), next(chunks)  # A decodes
        requests.start(0, b)
        assert wait(lambda: metric(engine, "oled_batch_requests") == 2), "B did not join A"
        requests.start(1, c)
        assert wait(lambda: metric(engine, "oled_queue_depth") == 1), "C did not queue"
        stream.close()  # A's client leaves
        requests.join()
        assert not requests.errors
        assert requests.answers[0][:2] == expected["B"][:2]
        assert requests.answers[1] == expected["C"]
        assert requests.ended[1] < requests.ended[0]  # C took A's slot: it did not wait for B
        assert wait(lambda: cancelled(engine) > left), "A was not cancelled"
        assert wait(lambda: metric(engine, "oled_batch_requests") == 0), "the batch is not empty"


def test_a_failed_forward_fails_the_batch_and_the_next_requests_decode(
    batched, reference, monkeypatch
):
    client, engine = batched
    real = BatchDecoder.step

    def broken(self):
        if len(self.active) == 2:
            raise RuntimeError("device lost")
        return real(self)

    monkeypatch.setattr(BatchDecoder, "step", broken)
    requests = Requests(client)
    requests.start(0, LONG)
    requests.start(1, replace(LONG, prompt="KING HENRY:\nNow", stream=False))
    requests.join()
    assert sorted(requests.errors) == [0, 1] and not requests.answers
    assert all("device lost" in str(err) for err in requests.errors.values())
    monkeypatch.undo()
    ask = Ask(HELLO, 32)
    assert ask.send(client) == alone(reference, ask)


def test_offload_counters_count_a_shared_forward_once():
    """The offload engine's figures are the batch's totals; /metrics counts each copy once,
    however many requests the batch served."""
    engine = Engine(
        lambda: build_runtime(device="cpu", dtype="float32", budget=Budget("expert_fraction", 0.25))
    )
    app = create_app(engine, model_name=MODEL, max_tokens=4000)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=WAIT_S, max_retries=0)
        stream = client.completions.create(
            model=MODEL,
            prompt="ROMEO:",
            max_tokens=3000,
            stream=True,
            extra_body={"threshold": 1.0},
        )
        next(iter(stream))  # it decodes until its client leaves: one run of the batch
        requests = Requests(client)
        for i, ask in enumerate([Ask(HELLO, 16), Ask("ROMEO:", 16, stream=True)]):
            requests.start(i, ask)
        requests.join()
        assert not requests.errors
        stream.close()
        assert wait(lambda: cancelled(engine) == 1), "the stream was not cancelled"
        run = engine.runtime.offload_summary()
        assert run["copies"] > 0
        keys = ("copies", "hits", "misses")

        def counted() -> dict[str, float]:
            return {key: metric(engine, f"oled_expert_{key}_total") for key in keys}

        want = pytest.approx({key: run[key] for key in keys})
        assert wait(lambda: counted() == want, timeout=10) or counted() == want
