"""`oled serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

from oled.launch import RuntimeSpec, build, check


def served_name(spec: RuntimeSpec) -> str:
    """The model id clients use: the recipe's stem, the built-in's name or the directory's."""
    if spec.recipe is not None:
        return Path(spec.recipe).stem
    if spec.model.startswith("builtin:"):
        return spec.model.split(":", 1)[1]
    return Path(spec.model).expanduser().resolve().name or spec.model


def run_server(spec: RuntimeSpec, *, host: str, port: int, model_name: str | None,
               default_max_tokens: int, max_tokens: int,
               api_key: str | None) -> None:  # fmt: skip
    """Listen at once; the model loads in the background (`/health` is 503 until it is ready)."""
    check(spec)
    import uvicorn

    from oled.serve.app import create_app
    from oled.serve.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    engine = Engine(lambda: build(spec))
    name = model_name or served_name(spec)
    app = create_app(engine, model_name=name, default_max_tokens=default_max_tokens,
                     max_tokens=max_tokens, api_key=api_key)  # fmt: skip
    logging.getLogger("oled.serve").info("serving %r at http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
