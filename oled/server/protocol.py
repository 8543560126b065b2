"""OpenAI-compatible request models (pydantic, strict) and response builders.

Requests are validated strictly, like the OpenAI API: wrong types are not coerced ("5" is not an integer) and an
unknown field is an error ("Unrecognized request argument supplied"). Standard OpenAI fields that the engine has no
use for (top_p, penalties, logit_bias, user, ...) are accepted and ignored; fields it cannot honour (n > 1,
logprobs, echo, tools, ...) are answered with 400. The diffusion knobs are extra body fields: block_length,
threshold, steps, rule, cache.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .serving import RequestError

PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # accepted and ignored
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # diffusion decoding (extra body fields)
    block_length: int | None = None
    threshold: float | None = None
    steps: int | None = None
    rule: Literal["threshold", "low_confidence"] | None = None
    cache: Literal["none", "prefix", "dual"] | None = None


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
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc
             if isinstance(p, int) or not ("[" in p or p in ("str", "int", "float", "bool", "list", "dict"))]
    return ".".join(parts) or None


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; a failure becomes a 400 with an OpenAI error object."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err.get("loc", ()))
        param = _param(loc)
        if err["type"] == "extra_forbidden":
            raise RequestError(f"Unrecognized request argument supplied: {param}", param=param,
                               code="unknown_parameter") from None
        if err["type"] == "missing":
            raise RequestError(f"missing required parameter: {param}", param=param,
                               code="missing_required_parameter") from None
        if loc and loc[0] == "prompt":
            raise RequestError(f"prompt must be {PROMPT_TYPES}", param="prompt", code="invalid_type") from None
        if loc and loc[0] == "stop":
            raise RequestError("stop must be a string or a list of strings", param="stop", code="invalid_type") \
                from None
        raise RequestError(f"{param}: {err['msg']}", param=param, code="invalid_type") from None
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format {fmt.get('type')!r} is not supported", param="response_format")
    return req


# --------------------------------------------------------------------------------------------------- responses
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
