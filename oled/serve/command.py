"""`oled serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import logging

from oled.recipe import Recipe


def served_name(spec: Recipe) -> str:
    """The model id clients use: the recipe's stem, else the model's name."""
    return spec.name if spec.path is not None else spec.model.name


def run_server(spec: Recipe, *, host: str, port: int, model_name: str, max_tokens: int,
               api_key: str | None) -> None:  # fmt: skip
    """Listen at once; the model loads in the background (`/health` is 503 until it is ready).
    A request without max_tokens gets the spec's decoding.max_new_tokens."""
    import uvicorn

    from oled.runtime import build
    from oled.serve.app import create_app
    from oled.serve.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    engine = Engine(lambda: build(spec))
    app = create_app(engine, model_name=model_name, max_tokens=max_tokens, api_key=api_key,
                     default_max_tokens=spec.decoding.max_new_tokens)  # fmt: skip
    logging.getLogger("oled.serve").info("serving %r at http://%s:%d/v1", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
