"""Serving core: translate OpenAI requests into engine work, queue it, and run it on the one engine thread.

The engine decodes one request at a time (batch 1). Requests wait in a bounded FIFO queue in front of it; one
worker thread owns the engine and runs them in order. A job talks back to the asyncio side through an
`asyncio.Queue` fed with `loop.call_soon_threadsafe`: ("delta", index, text) as blocks commit, ("finish", index,
info) at the end of each prompt, ("error", RequestError) and finally ("done",). Cancelling a job (client gone,
server stopping) removes it from the queue, or stops the running generation at its next iteration through the
decoding loop's `cancelled` callback.

This module imports neither FastAPI nor pydantic: request objects are read by attribute.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from ..decoding.loop import ContextTooLong, NonFiniteError
from ..decoding.params import DecodeParams
from ..decoding.procedure import procedure_for, usable_positions
from .metrics import Metrics
from .text import IncrementalText

log = logging.getLogger("oled.server")

MAX_STOP = 4                     # OpenAI's limit on stop strings
GREEDY_BELOW = 1e-6             # temperatures this small sample the argmax: decoded as greedy
MAX_PROMPTS = 16                 # prompts of one /v1/completions request (run one after the other)
PARAM_NAMES = {"gen_length": "max_tokens", "block_length": "block_length", "steps": "steps",
               "threshold": "threshold", "temperature": "temperature", "rule": "rule", "cache": "cache",
               "seed": "seed"}


class RequestError(Exception):
    """An error answered with an OpenAI-style error object: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class QueueFull(RequestError):
    def __init__(self, limit: int):
        super().__init__(f"the server is busy: {limit} requests are already waiting for the engine; retry later",
                         status=429, type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


class InternalError(RequestError):
    """A 500 that says nothing about its cause (the traceback goes to the server's log, not to the client)."""

    def __init__(self):
        super().__init__("The server had an error while processing your request; its log has the details",
                         status=500, type="server_error", code="internal_error")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------------ request translation
@dataclass
class Prepared:
    """A validated request: prompt token ids (one list per prompt), decoding parameters and stop strings."""
    prompts: list[list[int]]
    params: DecodeParams
    stop: tuple[str, ...]


class Translator:
    """Maps OpenAI request fields onto DecodeParams and checks them against the model (context, vocabulary)."""

    def __init__(self, engine, names: list[str], defaults: DecodeParams | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.names = names
        self.defaults = defaults or DecodeParams()
        self.max_positions = self.config.max_position_embeddings
        per_token = self.tokenizer.max_chars_per_token()
        # a text longer than this cannot fit in the context whatever its tokens: refused without tokenizing it
        self.max_prompt_chars = None if per_token is None else self.max_positions * per_token

    def check_model(self, model: str | None) -> None:
        if model not in self.names:
            raise RequestError(f"The model {model!r} does not exist; this server serves {', '.join(self.names)}",
                               status=404, param="model", code="model_not_found")

    def completion_prompts(self, prompt, special_tokens: bool = False) -> list[list[int]]:
        """prompt: a string, a list of strings, a list of token ids, or a list of token-id lists. A string is
        tokenized as text unless special_tokens (then a special token written in it is that token)."""
        if isinstance(prompt, str):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise RequestError("prompt is empty", param="prompt")
        if len(items) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                ids = self.encode(p, "prompt", special_tokens)
            else:
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
                if bad:
                    raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})",
                                       param="prompt")
            if not ids:
                raise RequestError("prompt is empty", param="prompt")
            out.append(ids)
        return out

    def chat_prompt(self, messages, special_tokens: bool = False) -> list[list[int]]:
        """The chat template's ids: its markers special tokens, the contents text unless special_tokens."""
        if not messages:
            raise RequestError("messages must contain at least one message", param="messages")
        plain = []
        for i, m in enumerate(messages):
            content = m.content
            if content is None or content == []:         # OpenAI refuses both (null only goes with tool calls)
                raise RequestError(f"messages[{i}].content must be a string or a non-empty list of text parts, got "
                                   f"{'null' if content is None else '[]'}", param=f"messages.{i}.content",
                                   code="invalid_value")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text":
                        raise RequestError(f"messages[{i}].content: only text parts are supported, got "
                                           f"{part.type!r}", param=f"messages.{i}.content")
                    if part.text is None:
                        raise RequestError(f"messages[{i}].content[{j}]: a text part needs a 'text' string",
                                           param=f"messages.{i}.content.{j}.text", code="missing_required_parameter")
                    texts.append(part.text)
                content = "".join(texts)
            role = "system" if m.role == "developer" else m.role
            plain.append({"role": role, "content": content})
        self._check_length(len(self.tokenizer.chat_prompt(plain)), "messages")
        return [self.tokenizer.chat_ids(plain, special_tokens)]

    def encode(self, text: str, param: str, special_tokens: bool = False) -> list[int]:
        """Tokenize a prompt (slow for long texts: callers run this off the event loop)."""
        self._check_length(len(text), param)
        return self.tokenizer.encode(text, special_tokens)

    def _check_length(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(f"This model's maximum context length is {self.max_positions} tokens; a prompt of "
                               f"{chars} characters needs more than that. Please shorten the prompt.",
                               param=param, code="context_length_exceeded")

    def params(self, req, prompts: list[list[int]], prompt_param: str) -> Prepared:
        d = self.defaults
        if getattr(req, "n", None) not in (None, 1):
            raise RequestError("only n=1 is supported (the engine decodes one sequence per request)", param="n")
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
            if getattr(req, name, None):
                raise RequestError(f"{name} is not supported by this server", param=name)
        if getattr(req, "best_of", None) not in (None, 1):
            raise RequestError("only best_of=1 is supported", param="best_of")
        block = req.block_length if req.block_length is not None else (d.block_length or self.config.block_length)
        if block > self.max_positions:
            raise RequestError(f"block_length {block} exceeds the model's context of {self.max_positions}",
                               param="block_length")
        usable = usable_positions(self.config, block)     # positions the (padded) canvas may use
        longest = max(len(p) for p in prompts)
        room = usable - longest
        max_tokens = getattr(req, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = req.max_tokens
        if max_tokens is None:
            if room <= 0:
                raise self._too_long(longest, 1, block, prompt_param)
            gen = min(d.gen_length, room)
        else:
            if max_tokens > self.max_positions:
                raise RequestError(f"max_tokens {max_tokens} exceeds the model's context of {self.max_positions} "
                                   f"tokens", param="max_tokens", code="invalid_value")
            if max_tokens > room:
                raise self._too_long(longest, max_tokens, block, prompt_param)
            gen = max_tokens
        temperature = d.temperature if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= 2.0:
            raise RequestError(f"temperature must be between 0 and 2, got {temperature}", param="temperature",
                               code="invalid_value")
        if temperature < GREEDY_BELOW:
            temperature = 0.0          # logits / 1e-38 overflow to inf (NaN probabilities); this samples the argmax
        stop = req.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stop) > MAX_STOP:
            raise RequestError(f"at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
        seed = req.seed if req.seed is not None else d.seed
        if seed is None and temperature > 0:
            seed = secrets.randbits(63)        # OpenAI's meaning: without a seed, every request samples afresh
        params = replace(d, gen_length=gen, block_length=block, temperature=temperature, seed=seed,
                         steps=req.steps if req.steps is not None else d.steps,
                         threshold=req.threshold if req.threshold is not None else d.threshold,
                         rule=req.rule if req.rule is not None else d.rule,
                         cache=req.cache if req.cache is not None else d.cache,
                         stop=tuple(s for s in stop if s))
        try:
            params.validate()
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise RequestError(str(e).replace("gen_length", "max_tokens"), param=PARAM_NAMES.get(name),
                               code="invalid_value") from None
        return Prepared(prompts=prompts, params=params, stop=params.stop)

    def _too_long(self, prompt_len: int, gen: int, block: int, param: str) -> RequestError:
        procedure = procedure_for(self.config)
        total = procedure.canvas_length(prompt_len, gen, block)
        padded = f", padded to blocks of {block}" if procedure.pads_to_blocks else ""
        return RequestError(f"This model's maximum context length is {self.max_positions} tokens. However, you "
                            f"requested {total} tokens ({prompt_len} in the prompt, {gen} for the completion"
                            f"{padded}). Please shorten the prompt or reduce max_tokens.",
                            param=param, code="context_length_exceeded")


# ------------------------------------------------------------------------------------------------------- jobs
@dataclass
class Job:
    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    worker: "EngineWorker | None" = None

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:            # the event loop is closed (server stopping): nobody is listening
            pass

    def cancel(self) -> None:
        """Client gone: drop the job from the queue, or stop its generation at the next iteration."""
        if not self.cancel_event.is_set():
            self.cancel_event.set()
            if self.worker is not None:
                self.worker.discard(self)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


def diffusion_info(results, records, params: DecodeParams, queue_s: float) -> dict:
    """The diffusion counters of a request (summed over its prompts), for the `diffusion` response field."""
    nfe = sum(r.nfe for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    decode_s = sum(r.decode_s for r in results)
    it = [r for r in records if r.kind == "iteration"]
    pairs = sum(r.pairs for r in it)
    return {
        "nfe": nfe,
        "cache_forwards": sum(r.cache_forwards for r in results),
        "tokens_per_forward": tokens / max(nfe, 1),
        "tpot_s": decode_s / max(tokens, 1),
        "prefill_s": sum(r.prefill_s for r in results),
        "decode_s": decode_s,
        "queue_s": queue_s,
        "iterations_per_block": [n for r in results for n in r.iterations_per_block],
        "block_length": params.block_length,
        "threshold": params.threshold,
        "hit_rate": sum(r.pairs_hit for r in it) / pairs if pairs else 1.0,
        "h2d_bytes": sum(r.bytes_h2d for r in records),
        "cpu_pairs": sum(r.pairs_cpu for r in records),
        "seed": params.seed if params.temperature > 0 else None,     # the seed sampled with (to reproduce it)
    }


class EngineWorker:
    """The one thread that owns the engine, and the bounded FIFO queue in front of it."""

    def __init__(self, engine, metrics: Metrics | None = None, max_queue: int = 16):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="oled-engine", daemon=True)

    # ------------------------------------------------------------------------------------------- queue side
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise RequestError("the server is shutting down", status=503, type="server_error",
                                   code="shutting_down")
            if len(self._waiting) >= self.max_queue and (self.running is not None or self._waiting):
                raise QueueFull(self.max_queue)
            job.worker = self
            self._waiting.append(job)
            self._cv.notify()

    def discard(self, job: Job) -> None:
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return                  # already running (it sees the flag) or finished
        self.metrics.record_request(time.perf_counter() - job.created, 0.0, cancelled=True)
        job.push(("done",))

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = self.running
            self._cv.notify_all()
        for job in waiting:
            job.cancel_event.set()
            job.push(("error", RequestError("the server is shutting down", status=503, type="server_error",
                                            code="shutting_down")))
            job.push(("done",))
        if running is not None:
            running.cancel_event.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ engine side
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self.running = job
            try:
                self._execute(job)
            except BaseException as e:        # never let one request take the engine thread down
                log.exception("request failed")
                job.push(("error", InternalError()))
                job.push(("done",))
                if not isinstance(e, Exception):
                    raise
            finally:
                with self._cv:
                    self.running = None

    def _execute(self, job: Job) -> None:
        job.started = time.perf_counter()
        queue_s = job.started - job.created
        engine, prep = self.engine, job.prepared
        results, records = [], []
        for index, prompt_ids in enumerate(prep.prompts):
            if job.cancelled:
                break
            engine.manager.stats.reset()           # per-request statistics; keeps the server's memory bounded
            text = IncrementalText(engine.tokenizer, prep.stop)

            def on_block(new_ids, finished, index=index, text=text):
                delta = text.add(new_ids, finished)
                if delta:
                    job.push(("delta", index, delta))

            try:
                res = engine.generate_ids(prompt_ids, replace(prep.params),
                                          on_block=on_block, cancelled=lambda t=text: job.cancelled or t.stopped)
            except ContextTooLong as e:
                job.push(("error", RequestError(str(e), param="max_tokens", code="context_length_exceeded")))
                job.push(("done",))
                return
            except NonFiniteError as e:          # the model's fault, not the request's
                job.push(("error", RequestError(str(e), status=500, type="server_error", code="non_finite_output")))
                job.push(("done",))
                return
            except ValueError as e:
                job.push(("error", RequestError(str(e))))
                job.push(("done",))
                return
            recs = list(engine.manager.stats.records)
            records.extend(recs)
            results.append(res)
            if job.cancelled:
                self.metrics.record_generation(res, len(prompt_ids), recs, "cancelled")
                break
            finish = "stop" if text.stopped else res.finish_reason
            self.metrics.record_generation(res, len(prompt_ids), recs, finish)
            tail = text.flush()
            if tail:
                job.push(("delta", index, tail))
            job.push(("finish", index, {"finish_reason": finish, "text": text.text,
                                        "prompt_tokens": len(prompt_ids), "completion_tokens": len(res.token_ids)}))
        end = time.perf_counter()
        self.metrics.record_request(queue_s, end - job.created, cancelled=job.cancelled)
        if not job.cancelled:
            job.push(("summary", diffusion_info(results, records, prep.params, queue_s)))
        job.push(("done",))
