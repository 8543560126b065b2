"""The OpenAPI document the server publishes (/openapi.json, /docs): request bodies and every error it answers.

The completion routes parse their bodies themselves (pydantic's JSON parser on the raw bytes, see protocol.parse),
so FastAPI cannot see them: their schemas are declared here (`openapi_extra`) and added to the document's
components. FastAPI's automatic 422 responses are dropped: validation errors are answered with 400, like OpenAI.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from . import protocol as P

REF_TEMPLATE = "#/components/schemas/{model}"
ERRORS = {
    400: "malformed JSON, a wrong type, an unknown field or value, a prompt too long for the context, or a Host "
         "header this server does not answer for",
    401: "missing or wrong API key (only when the server has one)",
    404: "unknown model or path",
    408: "the request body did not arrive in time (--body-timeout)",
    413: "the request body is larger than the limit (--max-body-mib)",
    415: "the body is not sent as Content-Type: application/json",
    429: "the queue in front of the engine is full (Retry-After says when to retry)",
    503: "the server is shutting down",
}
GUARDED = (400, 408, 413)          # any request: the Host check and the body limits run before routing


def errors(*statuses: int) -> dict:
    """FastAPI `responses` declaring OpenAI error objects for these statuses (plus the ones every request has)."""
    return {s: {"model": P.ErrorResponse, "description": ERRORS[s]} for s in sorted(set(GUARDED + statuses))}


def json_body(model) -> dict:
    """`openapi_extra` declaring a required JSON request body of this pydantic model."""
    schema = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# one server-sent event (in OpenAPI 3.1 an event stream's `schema` describes each event): its data is a JSON chunk,
# an error object, or the closing [DONE]
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
STREAM_OR_JSON = {200: {"description": "the completion (JSON), or server-sent events with \"stream\": true",
                        "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def publish_request_bodies(app: FastAPI) -> None:
    """Build the app's document with the request models in its components and without 422 responses."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in P.REQUEST_MODELS], ref_template=REF_TEMPLATE)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            for path in doc["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            schemas = doc["components"]["schemas"]
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
