"""The engine side of the server: one worker thread decodes the queued requests together, up to
`max_batch` at a time (oled.decoding.batch: one forward per iteration over all of them).

The model loads in that thread after the server starts listening (`/health` says 503 until it
is ready). Each request becomes a `Job`; jobs join the batch at iteration boundaries, in order
of arrival. A batch has one block length: a job with another one waits until the batch drains
(and the jobs behind it wait too), then a decoder of its block length takes over. The worker
streams text `Piece`s per finished block and then one `Done` or `Failed` into each job's asyncio
queue. Setting `job.cancel` (a client went away, or a stop string ended the text) drops the
generation from the batch at the next iteration. A forward that fails fails every job of the
batch; later jobs get a fresh decoder. `Engine.close` (the server is shutting down) ends every
open job at once with a 503 `Failed`. At most `max_batch + max_queue` jobs are open at once: one
more is refused with a 429 that says when to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from oled.decoding import BlockInfo, DecodeConfig, DecodeObserver
from oled.decoding.batch import BatchDecoder, Stream
from oled.decoding.observers import BatchIterationInfo
from oled.model.tokenizer import Tokenizer
from oled.recipe.schema import RUNTIME
from oled.runtime import Runtime, stats_dict
from oled.serve.metrics import OFFLOAD_COUNTERS, Metrics

log = logging.getLogger("oled.serve")


class RequestError(Exception):
    """A request the server refuses: HTTP status plus OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )
        self.headers = headers or {}


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
        if self.status == 503:
            return "service_unavailable"
        return "server_error" if self.status >= 500 else "invalid_request_error"


SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = (1, 60)  # the bounds of a full queue's Retry-After, in whole seconds


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


@dataclass(eq=False)
class Running:
    """A job in the batch (its stream's tag) and its text so far."""

    job: Job
    text: TextAssembler


class BatchWatch(DecodeObserver):
    """A batch decoder's hooks for the metrics: the requests of each forward, and the offload
    counters of the decoder's run counted so far (the offload engine's figures are the run's
    totals, from its first request on: a generation's own share cannot be told apart)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.counted: dict[str, float] = {}

    def on_generation_start(self, prompt_length: int) -> None:
        self.counted = {}

    def on_batch_iteration(self, info: BatchIterationInfo) -> None:
        self.metrics.batch_size.observe(len(info.rows))

    def uncounted(self, offload: dict[str, float] | None) -> dict[str, float] | None:
        """`offload` with its counters less what the run's earlier generations counted."""
        if offload is None:
            return None
        totals = {k: offload[k] for k in OFFLOAD_COUNTERS if k in offload}
        fresh = {k: v - self.counted.get(k, 0.0) for k, v in totals.items()}
        self.counted = totals
        return offload | fresh


class Engine:
    """Owns the runtime and the worker thread, which decodes up to `max_batch` jobs at once
    while up to `max_queue` more wait for a place in the batch."""

    def __init__(
        self,
        loader: Callable[[], Runtime],
        *,
        metrics: Metrics | None = None,
        max_batch: int = RUNTIME.max_batch,
        max_queue: int = RUNTIME.max_queue,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be at least 0, not {max_queue}")
        self._loader = loader
        self.max_batch, self.max_queue = max_batch, max_queue
        self._generation_s = 0.0  # a moving average of a generation's decode seconds
        self.metrics = metrics or Metrics()
        self.runtime: Runtime | None = None
        self.state = "loading"  # "ready", "failed", "stopping"
        self.error = ""
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # submitted, not yet ended
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._pending: deque[Job] = deque()  # taken from the queue, not yet in the batch
        self._batch: list[Stream] = []  # in the decoder, not yet done (tags: `Running`)
        self._watch = BatchWatch(self.metrics)
        self._thread = threading.Thread(target=self._main, name="oled-engine", daemon=True)
        self.metrics.watch(
            ready=lambda: self.state == "ready",
            queue_depth=lambda: self._jobs.qsize() + len(self._pending),
            batch_size=lambda: len(self._batch),
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> bool:
        """Let the worker finish (it is a daemon thread: a load that is still running does not
        keep the process); whether it has (False: it is still inside the loader or a
        forward)."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

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
        """Queue the job; a 429 with Retry-After when the batch and the queue are full."""
        with self._lock:
            self.require_ready()
            if sum(not j.cancel.is_set() for j in self._live) >= self.max_batch + self.max_queue:
                raise RequestError(
                    429,
                    f"the server is busy (the batch of {self.max_batch} and the queue of "
                    f"{self.max_queue} are full); retry later",
                    kind="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(self.retry_after())},
                )
            self._live.add(job)
        self._jobs.put(job)
        return job

    def retry_after(self) -> int:
        """Whole seconds until a place in the queue is likely to free: a generation's mean
        decode time over the batch's places (one leaves about that often), within
        RETRY_AFTER_S."""
        low, high = RETRY_AFTER_S
        return min(high, max(low, math.ceil(self._generation_s / self.max_batch)))

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
        if not self._load():
            return
        dec: BatchDecoder | None = None
        while self._receive(wait=not (self._batch or self._pending)):
            dec = self._admit(dec)
            if self._batch:
                assert dec is not None  # _admit gave the batch its decoder
                dec = self._step(dec)
        self.close()  # told to stop: nothing is left waiting

    def _load(self) -> bool:
        t0 = time.perf_counter()
        try:
            self.runtime = self._loader()
        except Exception as err:  # noqa: BLE001 - reported through /health
            log.exception("loading the model failed")
            self._set_state("failed", f"loading the model failed: {err}")
            return False
        self.metrics.load_seconds.set(time.perf_counter() - t0)
        self._set_state("ready")
        return True

    def _receive(self, wait: bool) -> bool:
        """Move the queued jobs to `_pending`, blocking for one when `wait`; False once `stop`
        was called."""
        try:
            job = self._jobs.get() if wait else self._jobs.get_nowait()
            while job is not None:
                self._pending.append(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            return True
        return False

    def _admit(self, dec: BatchDecoder | None) -> BatchDecoder | None:
        """Move pending jobs into the batch in order while it has room; one of another block
        length than the batch's waits for the batch to drain, then gets a decoder of its own."""
        while self._pending and len(self._batch) < self.max_batch:
            job = self._pending[0]
            if job.cancel.is_set():
                self._cancelled(self._pending.popleft())
                continue
            length = job.decode.block_length
            if dec is None or (dec.block_length != length and not self._batch):
                dec = self._decoder(length)
            if dec.block_length != length:
                break
            self._add(dec, self._pending.popleft())
        return dec

    def _decoder(self, block_length: int) -> BatchDecoder:
        assert self.runtime is not None
        dec = self.runtime.batch_decoder(self.max_batch, block_length=block_length)
        self._watch = BatchWatch(self.metrics)
        dec.observers.append(self._watch)
        return dec

    def _add(self, dec: BatchDecoder, job: Job) -> None:
        """Queue the job in the decoder (it joins at the next step); a job it refuses fails."""
        assert self.runtime is not None
        run = Running(job, TextAssembler(self.runtime.tokenizer, job.stops))
        try:
            stream = dec.add(job.prompt_ids, job.decode, cancelled=job.cancel.is_set, tag=run)
        except ValueError as err:
            self._fail(job, Failed(str(err), status=400, code="invalid_value"))
        except Exception as err:  # noqa: BLE001 - sent to the client as an error event
            log.exception("generation failed")
            self._fail(job, failure(err))
        else:
            self._batch.append(stream)

    def _step(self, dec: BatchDecoder) -> BatchDecoder | None:
        """One forward over the batch, then each finished block's text and each finished
        generation's `Done`. A failure fails every job of the batch and drops the decoder."""
        try:
            events = dec.step()
        except Exception as err:  # noqa: BLE001 - sent to every client of the batch
            log.exception("generation failed")
            for stream in self._batch:
                self._fail(stream.tag.job, failure(err))
            self._batch = []
            return None
        blocks = {ev.stream: ev.block for ev in events}
        for stream in self._batch:
            self._settle(stream, blocks.get(stream))
        self._batch = [s for s in self._batch if not s.done]
        return dec

    def _settle(self, stream: Stream, block: BlockInfo | None) -> None:
        """A stream after a step: the text of the block it finished, its end if it ended."""
        run: Running = stream.tag
        try:
            if block is not None and run.job in self._live:
                if piece := run.text.add(block.new_tokens):
                    run.job.emit(Piece(piece))
                if run.text.stopped:  # a stop string: this job only ends (the batch drops it)
                    run.job.cancel.set()
            if stream.done or run.text.stopped:
                self._finish(stream)
        except Exception as err:  # noqa: BLE001 - sent to the client as an error event
            log.exception("generation failed")
            run.job.cancel.set()
            self._fail(run.job, failure(err))

    def _finish(self, stream: Stream) -> None:
        """The job's last text and its `Done`, once, counted in the metrics."""
        run: Running = stream.tag
        job = run.job
        if job not in self._live:
            return
        if stream.stats.iterations == 0:  # cancelled before its first forward
            self._cancelled(job)
            return
        if tail := run.text.flush():
            job.emit(Piece(tail))
        assert self.runtime is not None  # loaded before any job ran
        stats = stats_dict(self.runtime, stream.stats)
        finish = "stop" if run.text.stopped else stream.stats.stopped
        done = Done(finish, len(job.prompt_ids), run.text.token_count(), stats)
        seconds = float(stats.get("seconds") or 0.0)
        self._generation_s += (seconds - self._generation_s) * (0.2 if self._generation_s else 1)
        self.metrics.record_generation(
            stats | {"offload": self._watch.uncounted(stats["offload"])},
            finish=finish,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            seconds=time.perf_counter() - job.submitted,
        )
        self._end(job, done)

    def _cancelled(self, job: Job) -> None:
        """A job whose client left before its generation began."""
        if job in self._live:
            self.metrics.generations.labels(finish_reason="cancelled").inc()
        self._end(job, Done("cancelled", len(job.prompt_ids), 0, {}))

    def _fail(self, job: Job, failed: Failed) -> None:
        if job in self._live:
            self.metrics.generations.labels(finish_reason="error").inc()
        self._end(job, failed)


def failure(err: Exception) -> Failed:
    return Failed(f"generation failed: {type(err).__name__}: {err}")


class TextAssembler:
    """Turns blocks of token ids into text pieces: whole characters only, cut at stop strings."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
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
