"""`oled serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import contextlib
import logging
import socket

import uvicorn

from oled.recipe import Recipe
from oled.serve.engine import Engine

GRACE_S = 1  # uvicorn's wait for open requests (normally over at once: see DrainingServer)
STARTUP_FAILURE = 3  # uvicorn's exit code when it cannot listen


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


def run_server(
    spec: Recipe, *, host: str, port: int, model_name: str, max_tokens: int, api_key: str | None
) -> None:
    """Listen at once; the model loads in the background (`/health` is 503 until it is ready).
    A request without max_tokens gets the spec's decoding.max_new_tokens; up to the spec's
    runtime.max_batch requests decode together."""
    from oled.runtime import build
    from oled.serve.app import create_app

    if not spec.decoding.use_cache:
        raise ValueError(
            "oled serve decodes requests together, which keeps each one's prefix "
            "cached: set decoding.use_cache to true"
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    engine = Engine(lambda: build(spec), max_batch=spec.runtime.max_batch)
    app = create_app(
        engine,
        model_name=model_name,
        max_tokens=max_tokens,
        api_key=api_key,
        default_max_tokens=spec.decoding.max_new_tokens,
    )
    logging.getLogger("oled.serve").info("serving %r at http://%s:%d/v1", model_name, host, port)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_S
    )
    server = DrainingServer(config, engine)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises Ctrl+C again once it is done
        server.run()
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
