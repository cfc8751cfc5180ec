"""FastAPI routes of the OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypedDict, TypeVar, cast
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oled.decoding import DecodeConfig
from oled.model.tokenizer import TokenizerError, check_text
from oled.serve import protocol as p
from oled.serve.engine import Done, Engine, Event, Failed, Job, Piece, RequestError, decode_config
from oled.serve.metrics import Metrics

MAX_BODY = 4 << 20
POLL_S = 0.25
KEEPALIVE_S = 5.0  # a stream silent this long gets a `: keep-alive` comment line
KEEPALIVE = ": keep-alive\n\n"
IGNORED_HEADER = "OLED-Ignored-Fields"
IGNORED_SHOWN = 16  # ignored fields named in the warning and the header (the body has all)
ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics")
MODEL_ROUTE = "/v1/models/{model}"
DONE = "data: [DONE]\n\n"
VALIDATION_CODES = {"unsupported_parameter": "unsupported_parameter"}
M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("oled.serve")


class ResponseMeta(TypedDict):
    """The fields every response and chunk of one request shares."""

    id: str
    created: int
    model: str


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> p.ErrorResponse:
    return p.ErrorResponse(error=p.ErrorBody(message=message, type=kind, param=param, code=code))


def error_response(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(message, kind, param, code).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def error_of(err: RequestError) -> JSONResponse:
    return error_response(err.status, err.message, err.kind, err.param, err.code, err.headers)


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


def route_label(path: str) -> str:
    """The route a request path counts under in the metrics."""
    if path in ROUTES:
        return path
    return MODEL_ROUTE if path.startswith("/v1/models/") else "other"


class CountRequests:
    """ASGI middleware: count responses by route and status without touching the body."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_label(scope["path"])

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class CatchErrors:
    """ASGI middleware: an unexpected exception is logged and answered with a 500 in OpenAI's
    shape, and the connection stays open (Starlette's last-resort handler re-raises, and uvicorn
    then drops the connection). One raised after the response started still propagates."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as err:
            if started:
                raise
            log.exception("request failed")
            response = error_response(500, f"internal error: {type(err).__name__}", "server_error")
            await response(scope, receive, send)


async def parse_body(request: Request, model: type[M]) -> tuple[M, list[str]]:
    """The JSON body validated against `model` and the names of its top-level fields that
    `model` does not know (ignored, with one warning line); RequestError (400/415/413)
    otherwise."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, "Content-Type must be application/json", code="bad_content_type")
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise RequestError(413, f"body larger than {MAX_BODY} bytes", code="body_too_large")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_json")
    check_unicode(data)
    try:
        parsed = model.model_validate(data)
    except ValidationError as err:
        raise invalid(err) from None
    ignored = sorted(key for key in data if key not in model.model_fields)
    if ignored:
        log.warning("%s: ignored unknown fields: %s", request.url.path, field_list(ignored))
    return parsed, ignored


def check_unicode(data: Any) -> None:
    """Every string of a parsed body is text UTF-8 can encode (JSON's escapes allow lone UTF-16
    surrogates, `"\\ud800"`, which no tokenizer takes); a 400 naming the field otherwise."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            check_string(value, path)
        elif isinstance(value, dict):
            for key in value:  # before any path is made of them
                check_string(key, path)
            todo += [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
        elif isinstance(value, list):
            todo += [(f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)]


def check_string(text: str, path: str) -> None:
    try:
        check_text(text, path or "the body")
    except TokenizerError as err:
        raise RequestError(400, str(err), param=path or None, code="invalid_value") from None


def invalid(err: ValidationError) -> RequestError:
    """The 400 for a body's first validation error, naming its field."""
    first = err.errors(include_url=False)[0]
    param = ".".join(str(x) for x in first["loc"]) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    code = VALIDATION_CODES.get(first["type"], "invalid_value")
    return RequestError(400, message, param=param, code=code)


class Server:
    """Request handling shared by the routes."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        default_max_tokens: int,
        max_tokens: int,
        api_key: str | None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.engine = engine
        self.keepalive_s = keepalive_s
        self.max_tokens = max_tokens
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key
        self.created = p.now()

    def authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise RequestError(401, "invalid or missing API key", code="invalid_api_key")

    def model_card(self, name: str) -> p.ModelCard:
        """The served model's card; 404 for any other name."""
        if name != self.model_name:
            raise RequestError(
                404,
                f"the model {name!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return p.ModelCard(id=name, created=self.created)

    def make_job(self, req: p.SamplingParams, prompt_ids: list[int]) -> Job:
        """Check the request against the loaded model and queue it."""
        rt = self.engine.require_ready()
        self.model_card(req.model)  # 404 unless it names the served model
        decode = self.decoding(req, rt.decode)
        check_length(prompt_ids, decode, rt.config.max_position_embeddings)
        job = Job(prompt_ids, decode, asyncio.get_running_loop(), stops=req.stops)
        return self.engine.submit(job)

    def decoding(self, req: p.SamplingParams, base: DecodeConfig) -> DecodeConfig:
        """The request's decoding: the server's with the request's fields over it."""
        wanted = req.wanted_tokens() or min(self.default_max_tokens, self.max_tokens)
        if wanted > self.max_tokens:
            raise RequestError(
                400,
                f"max_tokens is {wanted}; this server allows at most {self.max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        try:
            decode = decode_config(
                base,
                max_new_tokens=wanted,
                block_length=req.block_length,
                threshold=req.threshold,
                temperature=req.temperature,
                seed=req.seed,
            )
        except ValueError as err:
            raise RequestError(400, str(err), code="invalid_value") from None
        if req.top_p is not None and req.top_p < 1 and decode.temperature > 0:
            raise RequestError(
                400,
                "top_p: below 1 only with temperature 0 (greedy decoding "
                "keeps the likeliest token, which every nucleus holds); this "
                "server does no nucleus sampling",
                param="top_p",
                code="unsupported_value",
            )
        return decode

    async def events(self, job: Job, request: Request) -> AsyncGenerator[Event | None, None]:
        """The job's events, and None after each `keepalive_s` without one (the job waits in
        the queue, or a block takes that long); cancels the generation when the client goes
        away. One pending read of the queue lives across the polls (asyncio.wait does not
        cancel it on a timeout; before Python 3.12 wait_for could drop an event that came as
        it timed out)."""
        pending: asyncio.Future | None = None
        last = time.monotonic()
        try:
            while not job.finished:
                pending = pending or asyncio.ensure_future(job.next_event())
                done, _ = await asyncio.wait({pending}, timeout=min(POLL_S, self.keepalive_s))
                if done:
                    event, pending = pending.result(), None
                    last = time.monotonic()
                    yield event
                elif await request.is_disconnected():
                    return
                elif time.monotonic() - last >= self.keepalive_s:
                    last = time.monotonic()
                    yield None
        finally:
            if pending is not None:
                pending.cancel()
            if not job.finished:
                job.cancel.set()
                self.engine.metrics.disconnects.inc()


def check_length(prompt_ids: list[int], decode: DecodeConfig, limit: int) -> None:
    if not prompt_ids:
        raise RequestError(400, "the prompt is empty", param="prompt", code="invalid_value")
    bl = decode.block_length
    first = (len(prompt_ids) // bl) * bl
    need = first + -(-(len(prompt_ids) + decode.max_new_tokens - first) // bl) * bl
    if need > limit:
        raise RequestError(
            400,
            f"prompt ({len(prompt_ids)} tokens) + max_tokens "
            f"({decode.max_new_tokens}) need {need} positions; the model allows "
            f"{limit}",
            param="max_tokens",
            code="context_length_exceeded",
        )


def usage(done: Done) -> p.Usage:
    return p.Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
    )


def finish(done: Done) -> p.FinishReason:
    return "stop" if done.finish_reason == "stop" else "length"


def failure_event(failed: Failed) -> str:
    return sse(error_body(failed.message, failed.kind, code=failed.code))


def failure_response(failed: Failed) -> JSONResponse:
    return error_response(failed.status, failed.message, failed.kind, code=failed.code)


def chat_prompt(server: Server, req: p.ChatCompletionRequest) -> list[int]:
    rt = server.engine.require_ready()
    roles = {"developer": "system"}
    messages = [{"role": roles.get(m.role, m.role), "content": m.text()} for m in req.messages]
    return rt.tokenizer.encode(rt.tokenizer.render_chat(messages))


def completion_prompt(server: Server, req: p.CompletionRequest) -> list[int]:
    rt = server.engine.require_ready()
    if isinstance(req.prompt, str):
        return rt.tokenizer.encode(req.prompt)
    ids = cast(list[int], req.prompt)  # the validator made a list of one string a string
    vocab = rt.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise RequestError(
            400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value"
        )
    return list(ids)


async def chat_completions(server: Server, request: Request) -> Response:
    server.authorize(request)
    req, ignored = await parse_body(request, p.ChatCompletionRequest)
    job = server.make_job(req, chat_prompt(server, req))
    meta = ResponseMeta(id=p.new_id("chatcmpl"), created=p.now(), model=server.model_name)
    if req.stream:
        return streaming(chat_chunks(server, job, request, req, meta, ignored), ignored)
    text, end = await collect(server, job, request)
    if isinstance(end, Failed):
        return failure_response(end)
    choice = p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=finish(end))
    stats = oled_object(end, ignored)
    body = p.ChatCompletion(**meta, choices=[choice], usage=usage(end), oled=stats)
    return JSONResponse(body.model_dump(), headers=ignored_header(ignored))


async def chat_chunks(
    server: Server,
    job: Job,
    request: Request,
    req: p.ChatCompletionRequest,
    meta: ResponseMeta,
    ignored: list[str],
) -> AsyncGenerator[str, None]:
    def chunk(delta: p.Delta, reason: p.FinishReason | None = None, **extra: Any) -> str:
        choice = p.ChunkChoice(delta=delta, finish_reason=reason)
        return sse(p.ChatCompletionChunk(**meta, choices=[choice], **extra))

    def end(done: Done) -> list[str]:
        last = chunk(p.Delta(), finish(done), oled=oled_object(done, ignored))
        if not req.include_usage:
            return [last]
        return [last, sse(p.ChatCompletionChunk(**meta, choices=[], usage=usage(done)))]

    yield chunk(p.Delta(role="assistant", content=""))
    lines = sse_lines(server, job, request, lambda text: chunk(p.Delta(content=text)), end)
    async with contextlib.aclosing(lines):
        async for line in lines:
            yield line


async def completions(server: Server, request: Request) -> Response:
    server.authorize(request)
    req, ignored = await parse_body(request, p.CompletionRequest)
    ids = completion_prompt(server, req)
    echo = server.engine.require_ready().tokenizer.decode(ids) if req.echo else ""
    job = server.make_job(req, ids)
    meta = ResponseMeta(id=p.new_id("cmpl"), created=p.now(), model=server.model_name)
    if req.stream:
        return streaming(text_chunks(server, job, request, req, meta, echo, ignored), ignored)
    text, end = await collect(server, job, request)
    if isinstance(end, Failed):
        return failure_response(end)
    choice = p.TextChoice(text=echo + text, finish_reason=finish(end))
    stats = oled_object(end, ignored)
    body = p.Completion(**meta, choices=[choice], usage=usage(end), oled=stats)
    return JSONResponse(body.model_dump(), headers=ignored_header(ignored))


async def text_chunks(
    server: Server,
    job: Job,
    request: Request,
    req: p.CompletionRequest,
    meta: ResponseMeta,
    echo: str,
    ignored: list[str],
) -> AsyncGenerator[str, None]:
    def chunk(text: str, reason: p.FinishReason | None = None, **extra: Any) -> str:
        choice = p.TextChoice(text=text, finish_reason=reason)
        return sse(p.Completion(**meta, choices=[choice], **extra))

    def end(done: Done) -> list[str]:
        last = chunk("", finish(done), oled=oled_object(done, ignored))
        if not req.include_usage:
            return [last]
        return [last, sse(p.Completion(**meta, choices=[], usage=usage(done)))]

    if echo:
        yield chunk(echo)
    lines = sse_lines(server, job, request, chunk, end)
    async with contextlib.aclosing(lines):
        async for line in lines:
            yield line


async def sse_lines(
    server: Server,
    job: Job,
    request: Request,
    piece: Callable[[str], str],
    end: Callable[[Done], list[str]],
) -> AsyncGenerator[str, None]:
    """A stream's events as SSE lines: `piece(text)` per piece, then `end(done)`, else an error
    event; then `[DONE]`. A silence of `keepalive_s` gets a comment line (clients skip it)."""
    async with contextlib.aclosing(server.events(job, request)) as events:
        async for event in events:
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, Piece):
                yield piece(event.text)
                continue
            last = end(event) if isinstance(event, Done) else [failure_event(event)]
            for line in last:
                yield line
            yield DONE


async def collect(server: Server, job: Job, request: Request) -> tuple[str, Done | Failed]:
    parts: list[str] = []
    async with contextlib.aclosing(server.events(job, request)) as events:
        async for event in events:
            if isinstance(event, Piece):
                parts.append(event.text)
            elif event is not None:  # None: a silence, which a JSON answer cannot fill
                return "".join(parts), event
    return "".join(parts), Failed("the client went away")


def streaming(chunks: AsyncIterator[str], ignored: list[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | ignored_header(ignored)
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


def oled_object(done: Done, ignored: list[str]) -> dict[str, Any]:
    """A response's `oled` object: the generation's figures and the request's ignored fields."""
    return done.stats | {"ignored_fields": ignored}


def ignored_header(ignored: list[str]) -> dict[str, str]:
    """The response header that names the request's ignored fields (none when there are
    none)."""
    return {IGNORED_HEADER: field_list(ignored)} if ignored else {}


def field_list(names: list[str]) -> str:
    """The first IGNORED_SHOWN names, percent-encoded (`vendor_extra` stays as it is; a comma,
    a line break or a non-ASCII letter cannot break a header or a log line), then `...` if
    there are more."""
    shown = [quote(name, safe="") for name in names[:IGNORED_SHOWN]]
    return ", ".join(shown + ["..."] * (len(names) > IGNORED_SHOWN))


def create_app(
    engine: Engine,
    *,
    model_name: str,
    default_max_tokens: int = 256,
    max_tokens: int = 4096,
    api_key: str | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> FastAPI:
    """The ASGI app; starting it starts the engine (which loads the model in the background).
    A stream that sends nothing for `keepalive_s` seconds gets an SSE comment line."""
    server = Server(
        engine,
        model_name=model_name,
        default_max_tokens=default_max_tokens,
        max_tokens=max_tokens,
        api_key=api_key,
        keepalive_s=keepalive_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(
        title="OLED-MoE", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server
    add_error_handlers(app)
    add_routes(app, server)
    app.add_middleware(CatchErrors)
    app.add_middleware(CountRequests, metrics=engine.metrics)  # outside: counts CatchErrors' 500s
    return app


def add_routes(app: FastAPI, server: Server) -> None:
    engine = server.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        body: dict[str, Any] = {"status": engine.state, "model": server.model_name}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=200 if engine.state == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.authorize(request)
        card = server.model_card(server.model_name)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> JSONResponse:
        server.authorize(request)
        return JSONResponse(server.model_card(model).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await chat_completions(server, request)

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        return await completions(server, request)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_request: Request, err: RequestError) -> JSONResponse:
        return error_of(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return error_response(err.status_code, str(err.detail), "invalid_request_error", code=code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(400, str(err.errors()[:1]), "invalid_request_error")
