"""Teacher-forced numerics: a candidate engine configuration against a reference one, on the same canvases.

The reference decodes each prompt normally; every forward's input (the canvas fed, masks included) and its logits
at the masked positions of the block are recorded, with every iteration's commits. The candidate then decodes the
same prompts with the reference's commits in place of its own (a `commits` source of the decoding loop), so its KV
cache and its policy's state follow the same committed tokens and it is fed exactly the reference's canvases in the
reference's order: its logits are compared forward by forward without diverging sequences, over every masked
position and over the positions the reference commits in that iteration (where a different argmax would commit
another token). A free candidate run then says how much the generated tokens themselves change.

Bookkeeping is NumPy on the host; the engines are built one after the other (one model in memory at a time).
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..config import EngineConfig
from ..decoding.loop import ContextTooLong, generate
from ..decoding.params import DecodeParams
from ..decoding.procedure import procedure_for
from ..engine import Engine
from ..env import environment
from ..models.config import ModelConfig

LOGIT_BYTES = 4                  # the LM head's logits are fp32 (kept as they come)


class TeacherForcingError(RuntimeError):
    """The candidate's run left the reference's: another forward, canvas or iteration than the recorded one."""


@dataclass
class ForwardRecord:
    kind: str                            # prefill, iteration or cache fill (ForwardInfo.kind)
    start: int
    kv_end: int
    rows: slice | None                   # the rows of `tokens` whose logits the forward returns (None: none)
    tokens: np.ndarray                   # the canvas fed, mask tokens included
    logits: np.ndarray | None = None     # fp32 [masked rows, vocab]: the logits the decoder reads (iterations)
    masked: np.ndarray | None = None     # bool [rows]: which rows of the window are masks (the logits' rows)


@dataclass
class IterationRecord:
    block: int
    step: int
    window_start: int
    commit: np.ndarray                   # over the window [window_start, block end)
    tokens: np.ndarray
    confidence: np.ndarray


@dataclass
class Recording:
    """One request's forwards and iterations, in order, and the tokens it produced."""
    prompt_ids: list[int]
    forwards: list[ForwardRecord] = field(default_factory=list)
    iterations: list[IterationRecord] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class CanvasRecorder:
    """The decoding loop's observer: records each forward's canvas and, for an iteration, its logits at the masked
    positions of the rows it returns. The logits' copy to the host is queued with the forward and taken once the
    iteration's prediction is on the host (the forward is done then), so the host never waits on the device inside
    a forward (a mapped forward with a CPU share waits for the host)."""

    def __init__(self, runner, prompt_ids: list[int]):
        self.runner, self.mask_id = runner, runner.config.mask_token_id
        self.recording = Recording(list(prompt_ids))
        self._pending = None                 # (ForwardRecord, HostCopy) of the last iteration forward

    def forwarded(self, info, tokens, kv_end, rows, logits) -> None:
        self._take()
        rec = ForwardRecord(info.kind, info.start, kv_end, rows, np.array(tokens, dtype=np.int64))
        self.recording.forwards.append(rec)
        if logits is not None:
            self._pending = (rec, self.runner.read_back(logits))

    def committed(self, block, step, window_start, commit, tokens, confidence) -> None:
        self._take()
        self.recording.iterations.append(IterationRecord(block, step, window_start, np.array(commit),
                                                         np.array(tokens), np.array(confidence)))

    def finish(self, token_ids: list[int]) -> Recording:
        self._take()
        self.recording.token_ids = list(token_ids)
        return self.recording

    def _take(self) -> None:
        if self._pending is None:
            return
        rec, copy = self._pending
        self._pending = None
        rec.masked = rec.tokens[rec.rows] == self.mask_id
        rec.logits = np.array(copy.wait()[rec.masked], dtype=np.float32)  # a copy: the pinned buffer is reused


class Teacher:
    """The decoding loop's commit source for the candidate: the reference's recorded commits, tokens and
    confidences, checked forward by forward against the run (its policy hears the reference's iterations)."""

    def __init__(self, recording: Recording):
        self.recording = recording
        self._forward = self._iteration = 0

    def begin_forward(self, info) -> None:
        forwards = self.recording.forwards
        if self._forward >= len(forwards):
            raise TeacherForcingError(f"the candidate runs more than the reference's {len(forwards)} forwards")
        ref = forwards[self._forward]
        if (ref.kind, ref.start, len(ref.tokens)) != (info.kind, info.start, info.tokens):
            raise TeacherForcingError(f"forward {self._forward}: the reference ran a {ref.kind} of {len(ref.tokens)} "
                                      f"tokens at {ref.start}, the candidate a {info.kind} of {info.tokens} at "
                                      f"{info.start}")
        self._forward += 1

    def iteration(self, block: int, step: int, window_start: int, block_start: int, masked: np.ndarray):
        iterations = self.recording.iterations
        if self._iteration >= len(iterations):
            raise TeacherForcingError(f"the candidate runs more than the reference's {len(iterations)} iterations")
        ref = iterations[self._iteration]
        if (ref.block, ref.step, ref.window_start, len(ref.commit)) != (block, step, window_start, len(masked)):
            raise TeacherForcingError(f"the candidate is at block {block} step {step}, the reference's next "
                                      f"iteration is block {ref.block} step {ref.step}")
        self._iteration += 1
        return ref.commit, ref.tokens, ref.confidence

    def end_request(self, token_ids: list[int]) -> None:
        if list(token_ids) != self.recording.token_ids:
            raise TeacherForcingError("the teacher-forced candidate ended with other tokens than the reference")


@dataclass
class LogitDiff:
    """One iteration forward's logits at the masked positions, the candidate's against the reference's."""
    forward: int                         # the forward's number in its request
    block: int
    step: int
    positions: int
    vocab: int
    max_abs: float
    sum_abs: float                       # over positions x vocabulary (for the means)
    argmax_equal: int                    # positions whose argmax is the reference's
    committed: int                       # positions the reference committed in this iteration
    committed_equal: int                 # of those, the positions whose argmax is the reference's

    @property
    def elements(self) -> int:
        return self.positions * self.vocab


def logit_diff(ref: np.ndarray, cand: np.ndarray, committed: np.ndarray) -> tuple[float, float, int, int, int]:
    """(largest |difference|, sum of |differences|, rows with the same argmax, committed rows, committed rows with the
    same argmax) of two [rows, vocab] arrays, `committed` a bool [rows]."""
    diff = np.abs(ref.astype(np.float64) - cand.astype(np.float64))
    same = ref.argmax(axis=1) == cand.argmax(axis=1)
    return ((float(diff.max()) if diff.size else 0.0), float(diff.sum()), int(same.sum()), int(committed.sum()),
            int(same[committed].sum()))


def compare_recordings(ref: Recording, cand: Recording) -> list[LogitDiff]:
    """Per iteration forward, the logits' difference; the candidate must have been fed the reference's canvases."""
    if len(ref.forwards) != len(cand.forwards):
        raise TeacherForcingError(f"the reference ran {len(ref.forwards)} forwards, the candidate "
                                  f"{len(cand.forwards)}")
    diffs, iterations = [], iter(ref.iterations)
    for n, (a, b) in enumerate(zip(ref.forwards, cand.forwards)):
        if (a.kind, a.start, a.kv_end, a.rows) != (b.kind, b.start, b.kv_end, b.rows) or \
                not np.array_equal(a.tokens, b.tokens):
            raise TeacherForcingError(f"forward {n}: the candidate was fed another canvas than the reference")
        if a.logits is None:
            continue
        it = next(iterations)
        if len(it.commit) != len(a.masked):
            raise TeacherForcingError(f"forward {n}: its commits cover {len(it.commit)} positions, its logits' window "
                                      f"{len(a.masked)}")
        diffs.append(LogitDiff(n, it.block, it.step, *a.logits.shape,
                               *logit_diff(a.logits, b.logits, it.commit[a.masked])))
    return diffs


def token_matches(ref: list[int], cand: list[int]) -> tuple[int, int]:
    """(positions holding the same token, the longer output's length): a free run's token agreement."""
    return sum(a == b for a, b in zip(ref, cand)), max(len(ref), len(cand))


def fraction(part: float, whole: float) -> float:
    return part / whole if whole else 1.0


def summarize(diffs: list[LogitDiff]) -> dict:
    """Largest and mean absolute difference and argmax agreement over every compared position of `diffs`."""
    positions = sum(d.positions for d in diffs)
    elements = sum(d.elements for d in diffs)
    return {"forwards": len(diffs), "positions": positions,
            "max_abs": max((d.max_abs for d in diffs), default=0.0),
            "mean_abs": sum(d.sum_abs for d in diffs) / elements if elements else 0.0,
            "argmax_agreement": fraction(sum(d.argmax_equal for d in diffs), positions),
            "committed_positions": sum(d.committed for d in diffs),
            "committed_agreement": fraction(sum(d.committed_equal for d in diffs), sum(d.committed for d in diffs))}


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    diffs: list[LogitDiff]
    reference_tokens: list[int]
    candidate_tokens: list[int]          # the free (not teacher-forced) candidate run's

    def summary(self) -> dict:
        return {"id": self.id, "prompt_tokens": self.prompt_tokens, **summarize(self.diffs),
                "free_token_agreement": fraction(*token_matches(self.reference_tokens, self.candidate_tokens)),
                "free_tokens_equal": self.reference_tokens == self.candidate_tokens}


@dataclass
class Comparison:
    reference: EngineConfig
    candidate: EngineConfig
    reference_engine: str                # Engine.describe()
    candidate_engine: str
    params: DecodeParams
    prompts: list[PromptResult]
    environment: dict

    def total(self) -> dict:
        diffs = [d for p in self.prompts for d in p.diffs]
        matches = [token_matches(p.reference_tokens, p.candidate_tokens) for p in self.prompts]
        return {"id": "all", "prompt_tokens": sum(p.prompt_tokens for p in self.prompts), **summarize(diffs),
                "free_token_agreement": fraction(sum(m[0] for m in matches), sum(m[1] for m in matches)),
                "free_tokens_equal": all(p.reference_tokens == p.candidate_tokens for p in self.prompts)}

    def to_dict(self) -> dict:
        return {"reference": {"engine": self.reference.to_dict(), "describe": self.reference_engine},
                "candidate": {"engine": self.candidate.to_dict(), "describe": self.candidate_engine},
                "decode": asdict(self.params), "total": self.total(),
                "prompts": [{**p.summary(), "forwards": [
                    {"forward": d.forward, "block": d.block, "step": d.step, **summarize([d])} for d in p.diffs]}
                    for p in self.prompts],
                "environment": self.environment}


def check_costs(config, prompts: list[list[int]], params: DecodeParams, max_forwards: int,
                max_logit_bytes: float) -> None:
    """Refuse up front a run whose forwards (at most one prefill and each block's schedule) or whose recorded
    logits (at most the block's masks at each iteration of the schedule) exceed the limits, or a prompt too long."""
    procedure, B = procedure_for(config), params.block_length or config.block_length
    forwards = rows = 0
    for ids in prompts:
        total = procedure.canvas_length(len(ids), params.gen_length, B)
        if total > config.max_position_embeddings:
            raise ContextTooLong(f"a prompt of {len(ids)} tokens with --gen-length {params.gen_length} takes {total} "
                                 f"positions; the model supports {config.max_position_embeddings}")
        forwards += 1
        for block in procedure.blocks(len(ids), params.gen_length, B):
            schedule = procedure.schedule(block, params, B)
            committed_before = np.concatenate([[0], np.cumsum(schedule)[:-1]])
            forwards += len(schedule)
            rows += int(np.maximum(block.end - block.start - committed_before, 0).sum())
    if forwards > max_forwards:
        raise ValueError(f"these prompts may take up to {forwards} forwards a configuration, above --max-forwards "
                         f"{max_forwards}: fewer prompts or a shorter --gen-length")
    need = rows * config.vocab_size * LOGIT_BYTES
    if need > max_logit_bytes:
        raise ValueError(f"the reference's logits at the masked positions may take up to {need / 2**30:.2f} GiB, "
                         f"above --max-logits-gib {max_logit_bytes / 2**30:g}: fewer prompts or a shorter "
                         f"--gen-length")


def record(engine: Engine, prompt_ids: list[int], params: DecodeParams, teacher: Teacher | None = None) -> Recording:
    """One request on `engine`, every forward recorded; with `teacher`, its commits are the teacher's."""
    recorder = CanvasRecorder(engine.runner, prompt_ids)
    result = generate(engine.runner, prompt_ids, params, commits=teacher, observer=recorder)
    return recorder.finish(result.token_ids)


def close(engine: Engine) -> None:
    """Detach and close the engine's expert manager (a CPU job in flight finishes) before it is dropped."""
    manager = engine.runner.detach()
    if manager is not None:
        manager.close()


def free_device_memory() -> None:
    """After an engine is dropped: its tensors collected, CUDA's cache emptied, before the next one is built."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def reference_pass(cfg: EngineConfig, prompts, params: DecodeParams, max_forwards: int, max_logit_bytes: float,
                   say) -> tuple[list, list[Recording], ModelConfig, str]:
    """The reference's runs, recorded: (prompts, recordings, the model's config, the engine in words)."""
    engine = Engine(cfg)
    try:
        prompts = prompts(engine.tokenizer)
        ids = [p.ids(engine.tokenizer) for p in prompts]
        check_costs(engine.config, ids, params, max_forwards, max_logit_bytes)
        say(f"reference: {engine.describe()}")
        return prompts, [record(engine, x, params) for x in ids], engine.config, engine.describe()
    finally:
        close(engine)


def candidate_pass(cfg: EngineConfig, prompts: list, recordings: list[Recording], model_config: ModelConfig,
                   params: DecodeParams, say) -> tuple[list[PromptResult], str, dict]:
    """The candidate's teacher-forced runs against the recordings, then its free runs: (per prompt, the engine in
    words, where it ran)."""
    engine = Engine(cfg)
    try:
        if (engine.config.vocab_size, engine.config.mask_token_id) != (model_config.vocab_size,
                                                                       model_config.mask_token_id):
            raise ValueError("the candidate's model is not the reference's (another vocabulary or mask token)")
        say(f"candidate: {engine.describe()}")
        results = [PromptResult(p.id, len(rec.prompt_ids),
                                compare_recordings(rec, record(engine, rec.prompt_ids, params, Teacher(rec))),
                                rec.token_ids, []) for p, rec in zip(prompts, recordings)]
        for result, rec in zip(results, recordings):
            result.candidate_tokens = generate(engine.runner, rec.prompt_ids, params).token_ids
        return results, engine.describe(), environment(engine.device)
    finally:
        close(engine)


def compare(reference: EngineConfig, candidate: EngineConfig, prompts, params: DecodeParams, *,
            max_forwards: int, max_logit_bytes: float, say=lambda line: None) -> Comparison:
    """Run the prompts on the reference, then teacher-forced and free on the candidate, one engine in memory at a
    time. prompts(tokenizer) -> the workload's Prompts (.id, .ids(tokenizer)); both configurations must load the
    same model."""
    params.validate()
    prompts, recordings, model_config, reference_engine = reference_pass(reference, prompts, params, max_forwards,
                                                                         max_logit_bytes, say)
    free_device_memory()
    results, candidate_engine, env = candidate_pass(candidate, prompts, recordings, model_config, params, say)
    free_device_memory()
    return Comparison(reference, candidate, reference_engine, candidate_engine, params, results, env)
