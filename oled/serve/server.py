"""`oled serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import sys

import uvicorn

from oled.recipe import Recipe
from oled.serve.engine import Engine

GRACE_S = 1  # uvicorn's wait for open requests (normally over at once: see DrainingServer)
STARTUP_FAILURE = 3  # uvicorn's exit code when it cannot start
BACKLOG = 2048  # uvicorn's default
log = logging.getLogger("oled.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server that, when it shuts down (SIGTERM, Ctrl+C), first ends every open
    request with a 503 (a stream: an error event, then `[DONE]`), so that no client is left
    with a dropped connection and shutting down takes no longer than one forward."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.close()
        await super().shutdown(sockets)


def served_name(spec: Recipe) -> str:
    """The model id clients use: the recipe's stem, else the model's name."""
    return spec.name if spec.path is not None else spec.model.name


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets listening at `port` on every address of `host` (as uvicorn's own would); an
    OSError whose message is one line naming the host and the port when that is impossible."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as err:
        raise OSError(f"cannot listen on {host}: unknown host ({err.strerror}; --host)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise OSError(listen_error(err, host, port)) from None
    return sockets


def listen_error(err: OSError, host: str, port: int) -> str:
    """One line on why `port` on `host` cannot be listened on."""
    if err.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use (--port picks another)"
    if err.errno == errno.EACCES:
        return f"port {port} on {host}: permission denied (--port picks another)"
    if err.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: not an address of this machine (--host)"
    return f"cannot listen on port {port} on {host}: {err.strerror or err}"


def exit_now(code: int) -> None:
    """End the process without finalizing the interpreter: a daemon thread still inside torch
    (a model that is loading) would abort it (`terminate called without an active
    exception`)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_server(
    spec: Recipe, *, host: str, port: int, model_name: str, max_tokens: int, api_key: str | None
) -> None:
    """Listen at once (a port that cannot be listened on is an OSError before anything
    loads); the model loads in the background (`/health` is 503 until it is ready). A request
    without max_tokens gets the spec's decoding.max_new_tokens; up to the spec's
    runtime.max_batch requests decode together and runtime.max_queue more wait."""
    from oled.runtime import build
    from oled.serve.app import create_app

    if not spec.decoding.use_cache:
        raise ValueError(
            "oled serve decodes requests together, which keeps each one's prefix "
            "cached: set decoding.use_cache to true"
        )
    sockets = listen(host, port)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    engine = Engine(
        lambda: build(spec), max_batch=spec.runtime.max_batch, max_queue=spec.runtime.max_queue
    )
    app = create_app(
        engine,
        model_name=model_name,
        max_tokens=max_tokens,
        api_key=api_key,
        default_max_tokens=spec.decoding.max_new_tokens,
    )
    port = sockets[0].getsockname()[1]  # the one the system chose for port 0
    log.info("serving %r at http://%s:%d/v1", model_name, host, port)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_S
    )
    server = DrainingServer(config, engine)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises Ctrl+C again when done
            server.run(sockets=sockets)
        code = 0 if server.started else STARTUP_FAILURE
    except SystemExit as err:  # uvicorn's exit when its startup failed
        code = err.code if isinstance(err.code, int) else STARTUP_FAILURE
    except Exception:
        log.exception("the server failed")
        code = 1
    finally:
        for sock in sockets:
            sock.close()
    if not engine.stop(GRACE_S):
        exit_now(code)
    if code:
        raise SystemExit(code)
