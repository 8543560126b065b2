"""The FastAPI app: OpenAI-compatible endpoints over one engine (see serving.py for the queue and the worker).

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with server-sent events: one chunk per
committed block), GET /health, GET /metrics (Prometheus text). Every error is an OpenAI error object
{"error": {"message", "type", "param", "code"}} with a 4xx/5xx status; nothing a client sends can stop the server.
Before routing, the guards (guards.py) check the Host header and read the body within a size and a time limit;
tokenization runs on a worker thread, so a long prompt never stalls the event loop (and /health).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.params import DecodeParams
from . import BODY_TIMEOUT_S, MAX_BODY_BYTES
from . import protocol as P
from .guards import BodyLimits, HostCheck
from .metrics import Metrics
from .openapi import STREAM_OR_JSON, errors, json_body, publish_request_bodies
from .serving import EngineWorker, InternalError, Job, RequestError, Translator, new_id

log = logging.getLogger("oled.server")
POLL_S = 0.25            # how often a waiting non-streaming request checks that its client is still there
CLIENT_GONE = 499        # metrics status of a request whose client left before any answer (nginx's code)
DESCRIPTION = ("OpenAI-compatible server for MoE diffusion LLMs. Prompts and message contents are tokenized as "
               "text unless a request sets the field allow_special_tokens: " + P.ALLOW_SPECIAL_TOKENS)


class CountRequests:
    """ASGI middleware: count requests by endpoint and status code (pure ASGI: leaves streaming untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [CLIENT_GONE]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope.get("path", ""), status[0])


class JobStream(StreamingResponse):
    """A streaming response that cancels its job however the response ends (done, client gone, shutdown)."""

    def __init__(self, job: Job, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()          # a no-op once the job has finished


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine, *, served_model_name: str | None = None, api_key: str | None = None, max_queue: int = 16,
               defaults: DecodeParams | None = None, allowed_hosts: list[str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app for `engine`. served_model_name: the model id clients use (default: the engine's model name);
    api_key: require `Authorization: Bearer <key>` on /v1/* and /metrics; max_queue: requests that may wait for
    the engine before new ones get 429; defaults: decoding parameters of requests that do not set them;
    allowed_hosts: the Host header names answered (None: any; see guards.default_allowed_hosts); max_body_bytes,
    body_timeout_s: the largest request body (413 beyond) and the time it may take to arrive (408 beyond)."""
    names = [served_model_name or engine.model_name]
    metrics = Metrics()
    worker = EngineWorker(engine, metrics, max_queue=max_queue)
    translator = Translator(engine, names, defaults)
    created = P.now()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="OLED-MoE", description=DESCRIPTION, lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    publish_request_bodies(app)
    # the last added runs first: count every request, then check its Host, then read its body
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)
    app.add_middleware(CountRequests, metrics=metrics)

    # ------------------------------------------------------------------------------------------------ errors
    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return P.error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return P.error_response(RequestError(message, status=e.status_code, type=kind, headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return P.error_response(RequestError(f"{param}: {err['msg']}" if param else err["msg"], param=param))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return P.error_response(InternalError())

    # ----------------------------------------------------------------------------------------- auth, media type
    bearer = HTTPBearer(auto_error=False)           # declares the scheme in the OpenAPI document

    def check_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        token = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                               status=401, type="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})

    def require_json(request: Request) -> None:
        """415 unless the body is declared JSON: a web page can send text/plain or form data (or no type) to any
        address without asking (a CORS "simple request"), but not application/json."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise RequestError(f"the request body must be sent with Content-Type: application/json, got "
                               f"{media_type or 'none'}", status=415, code="unsupported_media_type")

    auth = [Depends(check_key)] if api_key is not None else []
    keyed = (401,) if api_key is not None else ()
    posted = auth + [Depends(require_json)]

    async def collect(job: Job, request: Request):
        """Wait for a job's events; None if the client went away (the job is then cancelled)."""
        finishes: dict[int, dict] = {}
        diffusion = None
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return None
                    continue
                if ev[0] == "finish":
                    finishes[ev[1]] = ev[2]
                elif ev[0] == "summary":
                    diffusion = ev[1]
                elif ev[0] == "error":
                    raise ev[1]
                elif ev[0] == "done":
                    break
        finally:
            if not finishes or diffusion is None:
                job.cancel()                 # handler cancelled or failed: do not keep the engine busy
        if diffusion is None:
            raise RequestError("the request was cancelled before it finished", status=503, type="server_error",
                               code="cancelled")
        return [finishes[i] for i in sorted(finishes)], diffusion

    async def events_sse(job: Job, rid: str, chat: bool, include_usage: bool):
        model = names[0]
        stamp = P.now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield _sse(P.chat_chunk(rid, model, stamp, {"role": "assistant", "content": ""}))
        pending = None                       # the last finish chunk waits for the diffusion summary
        prompt_tokens = completion_tokens = 0
        while True:
            ev = await job.events.get()
            if ev[0] == "summary" and pending is not None:
                pending["diffusion"] = ev[1]
            if pending is not None and ev[0] != "finish":
                yield _sse(pending)
                pending = None
            if ev[0] == "delta":
                _, index, text = ev
                yield _sse(P.chat_chunk(rid, model, stamp, {"content": text}) if chat
                           else P.completion_chunk(rid, model, stamp, index, text))
            elif ev[0] == "finish":
                if pending is not None:
                    yield _sse(pending)
                _, index, info = ev
                prompt_tokens += info["prompt_tokens"]
                completion_tokens += info["completion_tokens"]
                pending = (P.chat_chunk(rid, model, stamp, {}, info["finish_reason"]) if chat
                           else P.completion_chunk(rid, model, stamp, index, "", info["finish_reason"]))
            elif ev[0] == "error":
                yield _sse(ev[1].body())
            elif ev[0] == "done":
                break
        if include_usage:
            yield _sse(P.usage_chunk(rid, model, stamp, obj, prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"

    async def run(request: Request, req, prepared, chat: bool):
        job = Job(prepared, asyncio.get_running_loop())
        worker.submit(job)                   # 429 when the queue is full, 503 when stopping
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, events_sse(job, rid, chat, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await collect(job, request)
        if out is None:                      # nobody is listening any more
            return JSONResponse({"error": {"message": "client disconnected", "type": "invalid_request_error",
                                           "param": None, "code": "client_disconnected"}}, status_code=499)
        finishes, diffusion = out
        if chat:
            return JSONResponse(P.chat_completion(rid, names[0], P.now(), finishes[0], diffusion))
        return JSONResponse(P.completion(rid, names[0], P.now(), finishes, diffusion))

    # ---------------------------------------------------------------------------------------------- endpoints
    @app.get("/health", responses=errors(503))
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "unavailable", "model": names[0]}, status_code=503)
        return {"status": "ok", "model": names[0], "queue_depth": worker.depth,
                "running": int(worker.running is not None), "max_queue": worker.max_queue}

    @app.get("/metrics", dependencies=auth, responses=errors(*keyed), response_class=PlainTextResponse)
    async def get_metrics():
        text = metrics.render(engine, worker.depth, int(worker.running is not None), worker.max_queue)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth, responses=errors(*keyed))
    async def list_models():
        return {"object": "list",
                "data": [P.model_card(n, created, engine.config.max_position_embeddings) for n in names]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=errors(*keyed, 404))
    async def get_model(model_id: str):
        translator.check_model(model_id)
        return P.model_card(model_id, created, engine.config.max_position_embeddings)

    completion_errors = {**STREAM_OR_JSON, **errors(*keyed, 404, 415, 429, 503)}

    @app.post("/v1/completions", dependencies=posted, responses=completion_errors,
              openapi_extra=json_body(P.CompletionRequest))
    async def completions(request: Request):
        req = P.parse(P.CompletionRequest, await request.body())
        translator.check_model(req.model)
        prompts = await run_in_threadpool(translator.completion_prompts, req.prompt, bool(req.allow_special_tokens))
        return await run(request, req, translator.params(req, prompts, "prompt"), chat=False)

    @app.post("/v1/chat/completions", dependencies=posted, responses=completion_errors,
              openapi_extra=json_body(P.ChatCompletionRequest))
    async def chat_completions(request: Request):
        req = P.parse(P.ChatCompletionRequest, await request.body())
        translator.check_model(req.model)
        prompts = await run_in_threadpool(translator.chat_prompt, req.messages, bool(req.allow_special_tokens))
        return await run(request, req, translator.params(req, prompts, "messages"), chat=True)

    return app
