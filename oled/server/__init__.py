"""The OpenAI-compatible HTTP server (`oled serve`) and the pieces `oled chat` shares with it.

Layout: `text` (incremental detokenization and stop strings, no dependencies), `serving` (request translation, the
queue and the one worker thread that owns the engine), `metrics` (Prometheus text), `protocol` (pydantic request
models and response builders), `guards` (Host check, body size and time limits), `openapi` (the published
document) and `routes` (the FastAPI app). FastAPI, uvicorn and pydantic are optional
(`pip install 'oled[serve]'`): only `protocol`, `guards`, `openapi` and `routes` import them, and
`require_serve_deps()` reports a missing one in one line.
"""
from __future__ import annotations

import importlib.util

SERVE_DEPS = ("fastapi", "uvicorn", "pydantic")
MAX_BODY_BYTES = 8 * 2**20      # the default body limit: 16 prompts of 32k token ids fit, a 20 MB prompt does not
BODY_TIMEOUT_S = 30.0           # the default time a request body may take to arrive


def require_serve_deps() -> None:
    """Raise RuntimeError (one line) when an optional serving dependency is missing."""
    missing = [m for m in SERVE_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"the server needs {', '.join(missing)} (not installed): pip install 'oled[serve]'")


def create_app(engine, **options):
    """The FastAPI app serving `engine` (see routes.create_app for the options)."""
    require_serve_deps()
    from .routes import create_app as _create  # optional: the serve extra

    return _create(engine, **options)


__all__ = ["create_app", "require_serve_deps", "SERVE_DEPS", "MAX_BODY_BYTES", "BODY_TIMEOUT_S"]
