"""OpenAI-compatible request models (pydantic, strict) and response builders.

Requests are validated strictly, like the OpenAI API: wrong types are not coerced ("5" is not an integer) and an
unknown field is an error ("Unrecognized request argument supplied"). Standard OpenAI fields that the engine has no
use for (top_p, penalties, logit_bias, user, ...) are accepted (in their OpenAI ranges) and ignored; fields it cannot
honour (n > 1, logprobs, echo, tools, ...) are answered with 400. The diffusion knobs are extra body fields:
block_length, threshold, steps, rule, cache. Prompts and message contents are tokenized as text (a special token
written in them is its characters) unless the extra field allow_special_tokens is true.

Bodies are parsed and validated in one pass by pydantic's JSON parser (`model_validate_json`), which refuses what
Python's `json` lets through to fail later: lone surrogates in strings (they cannot be tokenized or encoded back),
nesting deeper than its recursion limit (no RecursionError), and NaN/Infinity.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from .serving import RequestError

PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of token-id lists"
SEED_RANGE = (-2**63, 2**63 - 1)         # OpenAI's seed is an int64
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
ALLOW_SPECIAL_TOKENS = ("Parse special tokens written in the prompt or the messages' contents (<|mask|>, "
                        "<|role_end|>, ...) as those tokens. Default false: they are tokenized as text, so that a "
                        "message cannot end its turn and open another, nor place a mask; the chat template's own "
                        "markers are the only special tokens.")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # accepted and ignored
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # diffusion decoding (extra body fields)
    block_length: int | None = Field(None, ge=1)
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    steps: int | None = Field(None, ge=1)
    rule: Literal["threshold", "low_confidence"] | None = None
    cache: Literal["none", "prefix", "dual"] | None = None
    allow_special_tokens: bool | None = Field(None, description=ALLOW_SPECIAL_TOKENS)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)     # name, refusal, ...: not used by the template
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


VALUE_ERRORS = {"greater_than", "greater_than_equal", "less_than_equal", "finite_number", "literal_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx answer: OpenAI's error object (declared in the OpenAPI document)."""
    error: ErrorDetail


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc
             if isinstance(p, int) or not ("[" in p or p in ("str", "int", "float", "bool", "list", "dict"))]
    return ".".join(parts) or None


def parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Parse and validate a raw JSON body; a failure becomes a 400 with an OpenAI error object."""
    if not raw.strip():
        raise RequestError("the request body is empty: send a JSON object", code="invalid_json")
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err.get("loc", ()))
        param = _param(loc)
        if err["type"] == "json_invalid":
            raise RequestError(f"could not parse the JSON body: {err['msg'].removeprefix('Invalid JSON: ')}",
                               code="invalid_json") from None
        if not loc:
            raise RequestError("the request body must be a JSON object", code="invalid_json") from None
        if err["type"] == "extra_forbidden":
            raise RequestError(f"Unrecognized request argument supplied: {param}", param=param,
                               code="unknown_parameter") from None
        if err["type"] == "missing":
            raise RequestError(f"missing required parameter: {param}", param=param,
                               code="missing_required_parameter") from None
        if loc[0] == "prompt":
            raise RequestError(f"prompt must be {PROMPT_TYPES}", param="prompt", code="invalid_type") from None
        if loc[0] == "stop":
            raise RequestError("stop must be a string or a list of strings", param="stop", code="invalid_type") \
                from None
        code = "invalid_value" if err["type"] in VALUE_ERRORS else "invalid_type"
        raise RequestError(f"{param}: {err['msg']}", param=param, code=code) from None
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format {fmt.get('type')!r} is not supported", param="response_format")
    return req


# --------------------------------------------------------------------------------------------------- responses
def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, created: int, finishes: list[dict], diffusion: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": f["text"], "logprobs": None, "finish_reason": f["finish_reason"]}
                        for i, f in enumerate(finishes)],
            "usage": usage(sum(f["prompt_tokens"] for f in finishes), sum(f["completion_tokens"] for f in finishes)),
            "diffusion": diffusion}


def chat_completion(rid: str, model: str, created: int, finish: dict, diffusion: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": finish["text"]},
                         "logprobs": None, "finish_reason": finish["finish_reason"]}],
            "usage": usage(finish["prompt_tokens"], finish["completion_tokens"]),
            "diffusion": diffusion}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "oled", "max_model_len": max_model_len}


def now() -> int:
    return int(time.time())
