"""The block-diffusion decoding loop. One loop; the rule and the cache mode are injected.

Bookkeeping (canvas, block state) is NumPy on the host; each iteration moves one block of predictions to the host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.config import ModelConfig
from ..policies.contract import ForwardInfo, IterationEvent
from ..runtime.backend import ExpertBackend
from .kv_cache import CACHE_MODES
from .params import DecodeParams
from .procedure import procedure_for
from .rules import make_rule


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str                   # "stop" (EOS) or "length"
    nfe: int = 0                         # denoising forwards
    committed: int = 0                   # tokens committed by those forwards (all blocks run)
    cache_forwards: int = 0              # prefill and cache-fill forwards
    iterations_per_block: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens (EOS included) per denoising forward: the block's padding past --gen-length and the
        positions after EOS, committed too, are not output."""
        return len(self.token_ids) / max(self.nfe, 1)

    @property
    def tpot_s(self) -> float:
        """Decode wall time (prefill excluded) per generated token, EOS included."""
        return self.decode_s / max(len(self.token_ids), 1)

    def counters(self) -> dict:
        return {"generated_tokens": len(self.token_ids), "nfe": self.nfe, "cache_forwards": self.cache_forwards,
                "tokens_per_forward": self.tokens_per_forward, "iterations_per_block": self.iterations_per_block,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "tpot_s": self.tpot_s,
                "finish_reason": self.finish_reason}


class ContextTooLong(ValueError):
    pass


class NonFiniteError(ValueError):
    """The model produced a NaN or infinite prediction (its weights or activations hold one): the request ends
    here, since a non-finite confidence can never be committed and the block would never finish."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(runner, prompt_ids: list[int], params: DecodeParams, *, on_block=None, timer=None, cancelled=None,
             commits=None, observer=None) -> GenerationResult:
    """Decode one request on `runner` (a ModelRunner: the model, its KV cache and graphs, and the expert backend its
    MoE layers call, which this loop tells what each forward is). on_block(new_token_ids, finished) is called as each
    block commits (streaming); cancelled() -> True stops at the next iteration (client gone). timer: a SectionTimer
    the forwards report their sections to (they run eagerly then). commits: a commit source (a TraceSource, its
    request begun) whose recorded commits, tokens and confidences replace the rule's; the model still runs.
    observer: told of every forward, observer.forwarded(info, tokens, kv_end, rows, logits) as it is queued (logits
    on the device, None for a cache forward; it must not wait on the device there: a mapped forward with a CPU share
    waits for the host), and of every iteration's commits, observer.committed(block, step, window_start, commit,
    tokens, confidence) once its prediction is on the host (oled/bench/teacher_forced.py records and compares them)."""
    config: ModelConfig = runner.config
    device, predict = runner.device, runner.predict
    manager: ExpertBackend = runner.experts
    B = params.block_length or config.block_length
    procedure = procedure_for(config)
    rule = make_rule(params.rule, params.threshold)
    mask_id, eos_id = config.mask_token_id, config.eos_token_id
    P = len(prompt_ids)
    if P == 0:
        raise ValueError("the prompt is empty")
    total = procedure.canvas_length(P, params.gen_length, B)
    if total > config.max_position_embeddings:
        padded = f" padded to blocks of {B}" if procedure.pads_to_blocks else ""
        raise ContextTooLong(f"prompt ({P} tokens) + generation ({params.gen_length}){padded} is "
                             f"{total} positions; the model supports {config.max_position_embeddings}")
    canvas = np.full(total, mask_id, dtype=np.int64)
    canvas[:P] = prompt_ids
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else 0)
    kv = runner.kv_cache(total)
    mode = CACHE_MODES[params.cache](config.block_causal)
    result = GenerationResult(token_ids=[], finish_reason="length")

    block_start = block_len = 0      # the block being decoded: its first canvas position and its length

    def forward(tokens: np.ndarray, start: int, kv_end: int, rows, kind: str):
        ids = torch.from_numpy(np.ascontiguousarray(tokens))       # the runner moves them (with a replay's inputs)
        info = ForwardInfo(kind=kind, start=start, tokens=len(tokens), block_start=block_start, block_length=block_len)
        if commits is not None:
            commits.begin_forward(info)
        manager.begin_forward(info)
        out = runner.forward(ids, start, kv, kv_end, rows, block_length=B, timer=timer)
        if observer is not None:
            observer.forwarded(info, tokens, kv_end, rows, out)
        manager.launched()                        # host work queued behind the forward (all-resident path)
        if kind == "iteration":
            result.nfe += 1
        else:
            result.cache_forwards += 1
            manager.end_forward()
        return out

    manager.on_request_start()
    with manager.overlapped():                    # the all-resident path's host work behind the GPU's
        t0 = time.perf_counter()
        blocks = procedure.blocks(P, params.gen_length, B)
        block_start, block_len = blocks[0].start, blocks[0].end - blocks[0].start   # the prefill's: the first block
        mode.prefill(forward, canvas, procedure.prefill_end(P, B))
        _sync(device)
        t1 = time.perf_counter()
        result.prefill_s = t1 - t0
        iteration = 0
        emitted = P
        for block in blocks:
            bs, be = block.start, block.end
            block_start, block_len = bs, be - bs
            schedule = procedure.schedule(block, params, B)
            step = 0
            while step < len(schedule):                   # every iteration commits at least one mask (or raises)
                ws = procedure.window_start(canvas, block, mask_id)
                masked = canvas[ws:be] == mask_id
                if not masked.any():
                    break
                if cancelled is not None and cancelled():
                    result.finish_reason = "cancelled"
                    break
                logits = mode.block_logits(forward, canvas, ws, be, step)
                x0, conf = predict(logits, params.temperature, generator)
                # the prediction's copy queued before the expert backend's end of the forward, which may queue the
                # next forward's waits for expert loads on the stream; its routing's copy before the host waits
                prediction = runner.read_back(torch.stack([x0.double(), conf.double()]))
                manager.end_forward()
                host = prediction.wait()
                x0_h, conf_h = host[0].astype(np.int64), np.where(masked, host[1], -np.inf)
                bad = masked & ~np.isfinite(host[1])
                if bad.any():
                    raise NonFiniteError(f"the model produced a non-finite prediction at position "
                                         f"{ws + int(np.flatnonzero(bad)[0])} (block {block.index}, iteration {step}): "
                                         f"its weights or activations hold NaN or Inf")
                if commits is None:
                    commit = rule.select(conf_h, schedule[step])
                else:
                    commit, x0_h, conf_h = commits.iteration(block.index, step, ws, bs, masked)
                if observer is not None:
                    observer.committed(block.index, step, ws, commit, x0_h, conf_h)
                canvas[ws:be][commit] = x0_h[commit]
                result.committed += int(commit.sum())
                inside = slice(bs - ws, None)                 # the event describes the block's own positions
                still = np.where(masked[inside], IterationEvent.MASKED, IterationEvent.DECODED)
                state = np.where(commit[inside], IterationEvent.COMMITTED, still).astype(np.int8)
                done = not (canvas[bs:be] == mask_id).any()
                manager.on_iteration(IterationEvent(block=block.index, step=step, iteration=iteration, state=state,
                                                    confidence=conf_h[inside], block_done=done,
                                                    tokens=canvas[bs:be].copy()))
                iteration += 1
                step += 1
            if result.finish_reason == "cancelled":
                break
            mode.finish_block(forward, canvas, bs, be)
            result.iterations_per_block.append(step)
            new_end = min(be, P + params.gen_length)
            out = canvas[P:new_end].tolist()
            eos_at = out.index(eos_id) if eos_id in out else -1
            result.token_ids = out[: eos_at + 1] if eos_at >= 0 else out
            upto = P + len(result.token_ids)
            new = canvas[emitted:upto].tolist()
            emitted = max(emitted, upto)
            # Stop after a block holding EOS, as LLaDA2's generate() does. LLaDA's runs every block, but the later ones
            # cannot change a token before the first EOS once no mask is left before it (only a prompt's mask tokens
            # can leave one: they compete for a block's commits).
            settled = not (canvas[P:upto] == mask_id).any()
            finished = (eos_at >= 0 and settled) or new_end >= P + params.gen_length
            if on_block is not None:
                on_block(new, finished)
            if finished:
                result.finish_reason = "stop" if eos_at >= 0 else "length"
                break
        manager.flush()
        _sync(device)
        result.decode_s = time.perf_counter() - t1
    if commits is not None and result.finish_reason != "cancelled":
        commits.end_request(result.token_ids)
    return result
