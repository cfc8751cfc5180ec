"""The engine side of the server: one worker thread decodes queued requests one at a time.

The model loads in that thread after the server starts listening (`/health` says 503 until it
is ready). Each request becomes a `Job`; the worker streams text `Piece`s and then one `Done` or
`Failed` into the job's asyncio queue. Setting `job.cancel` (a client went away) stops the
generation at the next forward through `Runtime.stream(cancelled=...)`. `Engine.close` (the
server is shutting down) ends every open job at once with a 503 `Failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from oled.decoding import DecodeConfig
from oled.runtime import Runtime, stats_dict
from oled.serve.metrics import Metrics

log = logging.getLogger("oled.serve")


class RequestError(Exception):
    """A request the server refuses: HTTP status plus OpenAI error fields."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code,
        )  # fmt: skip


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" or "length" ("cancelled" when nobody listens any more)
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500
    code: str = "generation_failed"

    @property
    def kind(self) -> str:
        """The OpenAI error type."""
        return "service_unavailable" if self.status == 503 else "server_error"


SHUTTING_DOWN = "the server is shutting down"


Event = Piece | Done | Failed


@dataclass(eq=False)
class Job:
    """One request on its way through the worker."""

    prompt_ids: list[int]
    decode: DecodeConfig
    loop: asyncio.AbstractEventLoop
    stops: list[str] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    finished: bool = False

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (called from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> Event:
        event = await self.events.get()
        if isinstance(event, Done | Failed):
            self.finished = True
        return event


class Engine:
    """Owns the runtime and the worker thread."""

    def __init__(self, loader: Callable[[], Runtime], *, metrics: Metrics | None = None) -> None:
        self._loader = loader
        self.metrics = metrics or Metrics()
        self.runtime: Runtime | None = None
        self.state = "loading"  # "ready", "failed", "stopping"
        self.error = ""
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # submitted, not yet ended
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="oled-engine", daemon=True)
        self.metrics.watch(ready=lambda: self.state == "ready", queue_depth=self._jobs.qsize)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Let the worker finish (it is a daemon thread: a load that is still running does not
        keep the process)."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        """Refuse new requests and end every queued or running one with a 503 `Failed`."""
        with self._lock:
            self.state = "stopping"
            live = list(self._live)
        for job in live:
            job.cancel.set()
            self._end(job, Failed(SHUTTING_DOWN, status=503, code="server_shutting_down"))

    def require_ready(self) -> Runtime:
        if self.state == "ready" and self.runtime is not None:
            return self.runtime
        messages = {"loading": "the model is still loading", "stopping": SHUTTING_DOWN}
        message = messages.get(self.state, self.error)
        raise RequestError(503, message, kind="service_unavailable", code="model_not_ready")

    def submit(self, job: Job) -> Job:
        with self._lock:
            self.require_ready()
            self._live.add(job)
        self._jobs.put(job)
        return job

    def _end(self, job: Job, event: Done | Failed) -> None:
        """Send the job's last event, once (the worker and `close` may both try)."""
        with self._lock:
            if job not in self._live:
                return
            self._live.discard(job)
        job.emit(event)

    def _set_state(self, state: str, error: str = "") -> None:
        """Leave "loading" (a shutdown that came first wins)."""
        with self._lock:
            if self.state == "loading":
                self.state, self.error = state, error

    # worker thread ------------------------------------------------------------------------

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.runtime = self._loader()
        except Exception as err:  # noqa: BLE001 - reported through /health
            log.exception("loading the model failed")
            self._set_state("failed", f"loading the model failed: {err}")
            return
        self.metrics.load_seconds.set(time.perf_counter() - t0)
        self._set_state("ready")
        while (job := self._jobs.get()) is not None:
            self._serve(job)

    def _serve(self, job: Job) -> None:
        if job.cancel.is_set():
            self.metrics.generations.labels(finish_reason="cancelled").inc()
            self._end(job, Done("cancelled", len(job.prompt_ids), 0, {}))
            return
        try:
            done = self._generate(job)
        except Exception as err:  # noqa: BLE001 - sent to the client as an error event
            log.exception("generation failed")
            self.metrics.generations.labels(finish_reason="error").inc()
            self._end(job, Failed(f"generation failed: {type(err).__name__}: {err}"))
            return
        self.metrics.record_generation(
            done.stats, finish=done.finish_reason, prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens, seconds=time.perf_counter() - job.submitted,
        )  # fmt: skip
        self._end(job, done)

    def _generate(self, job: Job) -> Done:
        rt = self.runtime
        assert rt is not None
        text = TextAssembler(rt.tokenizer, job.stops)
        blocks = rt.stream(job.prompt_ids, decode=job.decode, cancelled=job.cancel.is_set)
        with contextlib.closing(blocks):
            for block in blocks:
                piece = text.add(block.new_tokens)
                if piece:
                    job.emit(Piece(piece))
                if text.stopped:
                    break
        if tail := text.flush():
            job.emit(Piece(tail))
        stats = stats_dict(rt)
        finish = "stop" if text.stopped else rt.last_stats.stopped
        return Done(finish, len(job.prompt_ids), text.token_count(), stats)


class TextAssembler:
    """Turns blocks of token ids into text pieces: whole characters only, cut at stop strings."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        self.text = self.tokenizer.decode(self.ids)
        cut = min((i for s in self.stops if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        ready = len(self.text.rstrip("\ufffd")) - self.hold
        return self._take(ready)

    def flush(self) -> str:
        return self._take(len(self.text))

    def token_count(self) -> int:
        """The tokens that make the text: all of them, or up to the one that ends the text
        before a stop string (a token that straddles the cut counts)."""
        if not self.stopped:
            return len(self.ids)

        def covers(n: int) -> bool:
            return self.tokenizer.decode(self.ids[:n]).startswith(self.text)

        return bisect_left(range(len(self.ids) + 1), True, key=covers)

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : upto], upto
        return piece


def decode_config(base: DecodeConfig, **fields: Any) -> DecodeConfig:
    """`base` with the fields that are not None replaced (raises ValueError when invalid)."""
    return replace(base, **{k: v for k, v in fields.items() if v is not None})
