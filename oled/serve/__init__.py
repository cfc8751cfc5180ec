"""OpenAI-compatible HTTP server: protocol (pydantic), engine (one decoding worker), app (routes)."""
