"""The Python API: `oled.LLM(...)`."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

from .config import SECTIONS, SETTING_NAMES, EngineConfig
from .decoding.params import DecodeParams
from .engine import Engine
from .runtime.stats import Aggregate

STATS_HISTORY = 100     # per-request summaries LLM.stats() lists; older requests remain in the total only

_ENGINE_FIELDS = set(SETTING_NAMES) | set(SECTIONS)
_DECODE_FIELDS = {f.name for f in fields(DecodeParams)}


@dataclass
class Output:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    counters: dict = field(default_factory=dict)


class LLM:
    """LLM("path/to/checkpoint") or LLM(random_weights="llada2-mini"), with engine options as keywords
    (device, dtype, expert_budget, policy="oled:decay=0.5", ...: see EngineConfig)."""

    def __init__(self, model: str | None = None, **options):
        unknown = set(options) - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        if model is not None and model.startswith("random:"):
            options["random_weights"], model = model.split(":", 1)[1], None
        self.engine = Engine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer
        self._stats_runtime = None        # the manager the statistics below belong to
        self._stats_total = Aggregate()
        self._stats_requests: deque[dict] = deque(maxlen=STATS_HISTORY)

    def _params(self, params: dict) -> DecodeParams:
        unknown = set(params) - _DECODE_FIELDS
        if unknown:
            raise TypeError(f"unknown decoding parameter(s): {', '.join(sorted(unknown))}")
        decode = DecodeParams(**params)
        decode.validate()
        return decode

    def generate(self, prompts: str | list[str] | None = None, *, prompt_token_ids=None, on_block=None,
                 cancelled=None, allow_special_tokens: bool = False, **params) -> Output | list[Output]:
        """Generate for one prompt (returns an Output) or a list (returns a list). on_block(text_so_far, ids, done)
        streams each committed block; cancelled() -> True stops at the next iteration (finish_reason "cancelled").
        A prompt is tokenized as text (a special token written in it is its characters) unless
        allow_special_tokens=True."""
        single = isinstance(prompts, str) or (prompt_token_ids is not None and prompt_token_ids
                                              and isinstance(prompt_token_ids[0], int))
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("give prompts or prompt_token_ids")
            batch = [self.tokenizer.encode(p, allow_special_tokens)
                     for p in ([prompts] if isinstance(prompts, str) else prompts)]
        else:
            batch = [list(prompt_token_ids)] if single else [list(p) for p in prompt_token_ids]
        decode = self._params(params)
        outs = [self._one(ids, decode, on_block, cancelled) for ids in batch]
        return outs[0] if single else outs

    def chat(self, messages: list[dict], allow_special_tokens: bool = False, **params) -> Output:
        """One answer to the chat `messages` ({"role", "content"} dicts): the contents are text unless
        allow_special_tokens=True; the template's markers are the only special tokens."""
        return self.generate(prompt_token_ids=self.tokenizer.chat_ids(messages, allow_special_tokens), **params)

    def _one(self, prompt_ids: list[int], params: DecodeParams, on_block, cancelled) -> Output:
        ids: list[int] = []

        def stream(new_ids, finished):
            ids.extend(new_ids)
            if on_block is not None:
                on_block(self.tokenizer.decode(ids), new_ids, finished)

        manager = self.engine.manager
        if manager is not self._stats_runtime:          # a new runtime (set_runtime): its statistics start afresh
            self._stats_runtime, self._stats_total = manager, Aggregate()
            self._stats_requests.clear()
        manager.stats.reset()                           # the manager holds this request's records only
        res = self.engine.generate_ids(prompt_ids, params, on_block=stream, cancelled=cancelled)
        request = manager.stats.aggregate()
        self._stats_total += request
        self._stats_requests.append(dict(request.summary(), generated_tokens=len(res.token_ids)))
        text = self.tokenizer.decode(res.token_ids)
        finish = res.finish_reason
        for s in params.stop:
            if s and s in text:
                text, finish = text[: text.index(s)], "stop"
        return Output(text=text, token_ids=res.token_ids, prompt_token_ids=prompt_ids, finish_reason=finish,
                      counters=res.counters())

    def stats(self) -> dict:
        """Expert statistics (hit rates, H2D traffic, CPU work: see runtime/stats.py) summed over every request since
        the runtime was built, and under "requests" each of the last STATS_HISTORY requests' own, oldest first."""
        return dict(self._stats_total.summary(), requests=list(self._stats_requests))
