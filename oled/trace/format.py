"""The trace file: every call the decoding loop and the MoE layers made to the expert manager, with the routing.

One compressed NumPy archive (np.savez_compressed, any file name). `ops` is the call log, in order:
  (REQUEST, r)    on_request_start() of request r
  (BEGIN, kind)   begin_forward(kind) of the next forward (kind index into KINDS)
  (RUN, i)        run(layer, x, ids, weights) of run i: layer run_layer[i], rows run_offset[i]:run_offset[i+1] of
                  ids / weights (top-k expert ids and weights per token of the forward, token-major)
  (END, 0)        end_forward()
  (EVENT, j)      on_iteration(event j): block, step, iteration, done, per block position state, confidence and
                  token after the iteration (the committed token where committed)
Per forward: kind, start position, token count and the block's start (rows map to block positions: block position
= start + row - block start).
Per run, optionally, the predicted routing of the MoE layers 1, 2 and 3 after it (each of those layers' router
applied to this layer's input: what a prefetcher can know that many layers ahead; `prefetch` policies see distance
1): rows pred_offset[i]:pred_offset[i+1] of pred_ids for distance 1, of pred2_ids / pred3_ids (by pred2_offset /
pred3_offset) for distances 2 and 3; empty where no MoE layer is that far ahead. Predicted ids are uint8 where the
model has at most 256 experts. Format 1 (read as well) has distance 1 only, as int16.
Per request: prompt and output token ids. `header` is a JSON document: model shapes, engine and decoding settings,
the workload, the live run's statistics (for the replay check), git commit, date.
"""
from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..policies.contract import ForwardInfo, IterationEvent

REQUEST, BEGIN, RUN, END, EVENT = range(5)
KINDS = ("prefill", "iteration", "cache_fill")
FORMAT = "oled-trace/2"
READABLE = ("oled-trace/1", FORMAT)     # 1: predictions one layer ahead only
PREDICTION_DISTANCES = 3                # MoE layers ahead a recording predicts


@dataclass
class Trace:
    header: dict
    ops: np.ndarray                 # [N, 2] int32
    fwd_kind: np.ndarray            # [F] int8
    fwd_start: np.ndarray           # [F] int32
    fwd_tokens: np.ndarray          # [F] int32
    run_layer: np.ndarray           # [R] int32
    run_forward: np.ndarray         # [R] int32
    run_offset: np.ndarray          # [R+1] int64
    ids: np.ndarray                 # [rows, k] int16
    weights: np.ndarray             # [rows, k] float32
    pred_offset: np.ndarray         # [R+1] int64: distance 1
    pred_ids: np.ndarray            # [pred rows, k] uint8 or int16
    ev_forward: np.ndarray          # [V] int32: the iteration forward the event follows
    ev_block: np.ndarray
    ev_step: np.ndarray
    ev_iteration: np.ndarray
    ev_done: np.ndarray             # [V] bool
    ev_offset: np.ndarray           # [V+1] int64
    ev_state: np.ndarray            # [sum B] int8
    ev_conf: np.ndarray             # [sum B] float32
    req_prompt_offset: np.ndarray   # [Q+1]
    req_prompt_ids: np.ndarray
    req_output_offset: np.ndarray   # [Q+1]
    req_output_ids: np.ndarray
    fwd_block_start: np.ndarray = field(default=None)   # [F] int32: canvas position of the block being decoded
    fwd_request: np.ndarray = field(default=None)   # [F] int32, derived
    ev_token: np.ndarray = field(default=None)      # [sum B] int32: absent from traces recorded before it
    fwd_cpu_scale: np.ndarray = field(default=None)  # [F] float64: the scale of the CPU costs each forward planned
                                                     # on (runtime/cpu_feedback.py); absent: 1
    pred2_offset: np.ndarray = field(default=None)   # [R+1] int64: predictions two MoE layers ahead (format 2)
    pred2_ids: np.ndarray = field(default=None)
    pred3_offset: np.ndarray = field(default=None)   # [R+1] int64: three MoE layers ahead
    pred3_ids: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.fwd_block_start is None:   # traces before it was recorded: blocks at multiples of the block length
            self.fwd_block_start = self._block_starts_from_events()
        if self.fwd_request is None:
            req = np.full(len(self.fwd_kind), -1, dtype=np.int32)
            current, f = -1, 0
            for op, arg in self.ops:
                if op == REQUEST:
                    current = arg
                elif op == BEGIN:
                    req[f] = current
                    f += 1
            self.fwd_request = req

    def _block_starts_from_events(self) -> np.ndarray:
        """Each forward's block from the iteration event that follows it (prefills: the block after them)."""
        B = int(self.header["decode"]["block_length"])
        starts = np.zeros(len(self.fwd_kind), dtype=np.int32)
        pending, f = [], -1

        def finished_block():   # forwards after a request's last event (a cache fill): the block they finished
            for g in pending:
                starts[g] = starts[g - 1] if g else 0
            pending.clear()

        for op, arg in self.ops.tolist():
            if op == BEGIN:
                f += 1
                pending.append(f)
            elif op == EVENT:
                for g in pending:
                    starts[g] = self.ev_block[arg] * B
                pending.clear()
            elif op == REQUEST:
                finished_block()
        finished_block()
        return starts

    def forward_info(self, f: int) -> ForwardInfo:
        return ForwardInfo(kind=KINDS[self.fwd_kind[f]], start=int(self.fwd_start[f]), tokens=int(self.fwd_tokens[f]),
                           block_start=int(self.fwd_block_start[f]),
                           block_length=int(self.header["decode"]["block_length"]))

    # ------------------------------------------------------------------------------------------------ access
    @property
    def layers(self) -> list[int]:
        return list(self.header["model"]["moe_layers"])

    @property
    def has_predictions(self) -> bool:
        return bool(self.header.get("predictions"))

    def run_ids(self, i: int) -> np.ndarray:
        return self.ids[self.run_offset[i]: self.run_offset[i + 1]]

    def run_weights(self, i: int) -> np.ndarray:
        return self.weights[self.run_offset[i]: self.run_offset[i + 1]]

    @property
    def prediction_distances(self) -> int:
        """How many MoE layers ahead the trace records predictions (0: none)."""
        if not self.has_predictions:
            return 0
        return max(d for d in range(1, PREDICTION_DISTANCES + 1) if getattr(self, pred_arrays(d)[1]) is not None)

    def run_pred(self, i: int, ahead: int = 1) -> np.ndarray | None:
        """The routing of the MoE layer `ahead` layers after run i's, predicted from run i's input (None: not
        recorded, or no MoE layer that far ahead)."""
        offset_name, ids_name = pred_arrays(ahead)
        offset, ids = getattr(self, offset_name, None), getattr(self, ids_name, None)
        if offset is None or ids is None:
            return None
        a, b = offset[i], offset[i + 1]
        return ids[a:b] if b > a else None

    def event(self, j: int) -> IterationEvent:
        a, b = self.ev_offset[j], self.ev_offset[j + 1]
        return IterationEvent(block=int(self.ev_block[j]), step=int(self.ev_step[j]),
                              iteration=int(self.ev_iteration[j]), state=self.ev_state[a:b].copy(),
                              confidence=self.ev_conf[a:b].astype(np.float64), block_done=bool(self.ev_done[j]),
                              tokens=None if self.ev_token is None else self.ev_token[a:b].astype(np.int64))

    def prompt_ids(self, r: int) -> np.ndarray:
        return self.req_prompt_ids[self.req_prompt_offset[r]: self.req_prompt_offset[r + 1]]

    def output_ids(self, r: int) -> np.ndarray:
        return self.req_output_ids[self.req_output_offset[r]: self.req_output_offset[r + 1]]

    @property
    def num_requests(self) -> int:
        return len(self.req_prompt_offset) - 1

    def popularity(self) -> dict[int, dict[int, int]]:
        """layer -> expert -> tokens routed over every forward (what `oled calibrate` measures)."""
        pop: dict[int, dict[int, int]] = {}
        for layer in np.unique(self.run_layer).tolist():
            rows = [self.run_ids(i) for i in np.nonzero(self.run_layer == layer)[0]]
            experts, counts = np.unique(np.concatenate(rows).reshape(-1), return_counts=True)
            pop[layer] = dict(zip(experts.tolist(), counts.tolist()))
        return pop

    def describe(self) -> str:
        h = self.header
        kinds = {k: int((self.fwd_kind == i).sum()) for i, k in enumerate(KINDS)}
        return (f"{h['model']['name']}: {self.num_requests} requests, {len(self.fwd_kind)} forwards "
                f"({kinds['iteration']} iterations, {kinds['prefill']} prefills, {kinds['cache_fill']} cache fills), "
                f"{len(self.layers)} MoE layers x {h['model']['num_experts']} experts, top-{h['model']['top_k']}, "
                f"block {h['decode']['block_length']}; recorded with {h['live']['policy']} at "
                f"{h['live'].get('budget_fraction', 0):.0%} ({h['live'].get('slots_per_layer')} slots per layer) on "
                f"{h['env']['label']}")

    def first_requests(self, n: int) -> "Trace":
        """The trace of its first n requests (a smaller file for the same runs; the header's `live` statistics stay
        those of the whole recording and say so)."""
        if not 1 <= n <= self.num_requests:
            raise ValueError(f"the trace has {self.num_requests} requests; cannot keep {n}")
        if n == self.num_requests:
            return self
        cut = int(np.flatnonzero((self.ops[:, 0] == REQUEST) & (self.ops[:, 1] == n))[0])   # request n starts here
        ops = self.ops[:cut]
        F = int((ops[:, 0] == BEGIN).sum())
        R = int((ops[:, 0] == RUN).sum())
        V = int((ops[:, 0] == EVENT).sum())
        rows, ev_rows = int(self.run_offset[R]), int(self.ev_offset[V])
        preds = {}
        for d in range(1, PREDICTION_DISTANCES + 1):
            offset_name, ids_name = pred_arrays(d)
            offset, ids = getattr(self, offset_name), getattr(self, ids_name)
            if offset is not None and ids is not None:
                preds[offset_name], preds[ids_name] = offset[:R + 1], ids[:int(offset[R])]
        prompt_end, output_end = int(self.req_prompt_offset[n]), int(self.req_output_offset[n])
        header = dict(self.header, requests=list(self.header.get("requests", []))[:n],
                      subset=f"the first {n} of {self.num_requests} requests; `live` covers all of them")
        return Trace(header=header, ops=ops, fwd_kind=self.fwd_kind[:F], fwd_start=self.fwd_start[:F],
                     fwd_tokens=self.fwd_tokens[:F], fwd_block_start=self.fwd_block_start[:F],
                     fwd_cpu_scale=None if self.fwd_cpu_scale is None else self.fwd_cpu_scale[:F],
                     run_layer=self.run_layer[:R], run_forward=self.run_forward[:R],
                     run_offset=self.run_offset[:R + 1], ids=self.ids[:rows], weights=self.weights[:rows],
                     **preds,
                     ev_forward=self.ev_forward[:V], ev_block=self.ev_block[:V], ev_step=self.ev_step[:V],
                     ev_iteration=self.ev_iteration[:V], ev_done=self.ev_done[:V], ev_offset=self.ev_offset[:V + 1],
                     ev_state=self.ev_state[:ev_rows], ev_conf=self.ev_conf[:ev_rows],
                     ev_token=None if self.ev_token is None else self.ev_token[:ev_rows],
                     req_prompt_offset=self.req_prompt_offset[:n + 1], req_prompt_ids=self.req_prompt_ids[:prompt_end],
                     req_output_offset=self.req_output_offset[:n + 1], req_output_ids=self.req_output_ids[:output_end])

    # ------------------------------------------------------------------------------------------------ files
    def save(self, path) -> Path:
        path = Path(path)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {name: getattr(self, name) for name in ARRAYS + OPTIONAL_ARRAYS if getattr(self, name) is not None}
        header = json.dumps(self.header, default=_json_default).encode()
        with open(path, "wb") as f:
            np.savez_compressed(f, header=np.frombuffer(header, dtype=np.uint8), **arrays)
        return path

    @classmethod
    def load(cls, path) -> "Trace":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"trace file {str(path)!r} not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:   # truncated or not a trace
            raise ValueError(f"{path}: not an oled trace, or truncated ({e})") from None
        if "header" not in data or "ops" not in data:
            raise ValueError(f"{path}: not an oled trace (no header/ops)")
        header = json.loads(data.pop("header").tobytes().decode())
        if header.get("format") not in READABLE:
            raise ValueError(f"{path}: trace format {header.get('format')!r}, this version reads "
                             f"{', '.join(map(repr, READABLE))}")
        missing = [a for a in ARRAYS if a not in data]
        if missing:
            raise ValueError(f"{path}: trace lacks {', '.join(missing)}")
        return cls(header=header, **{a: data[a] for a in ARRAYS + OPTIONAL_ARRAYS if a in data})


ARRAYS = ("ops", "fwd_kind", "fwd_start", "fwd_tokens", "run_layer", "run_forward", "run_offset", "ids", "weights",
          "pred_offset", "pred_ids", "ev_forward", "ev_block", "ev_step", "ev_iteration", "ev_done", "ev_offset",
          "ev_state", "ev_conf", "req_prompt_offset", "req_prompt_ids", "req_output_offset", "req_output_ids")
OPTIONAL_ARRAYS = ("fwd_block_start", "ev_token", "fwd_cpu_scale",   # absent from older traces: the first
                   "pred2_offset", "pred2_ids", "pred3_offset", "pred3_ids")   # derived on load


def pred_arrays(ahead: int) -> tuple[str, str]:
    """The names of the offset and id arrays of the predictions `ahead` MoE layers ahead."""
    if not 1 <= ahead <= PREDICTION_DISTANCES:
        raise ValueError(f"a trace records predictions 1 to {PREDICTION_DISTANCES} MoE layers ahead, not {ahead}")
    return ("pred_offset", "pred_ids") if ahead == 1 else (f"pred{ahead}_offset", f"pred{ahead}_ids")


def expert_id_dtype(num_experts: int):
    """The smallest integer type that holds every expert id of a model."""
    return np.uint8 if num_experts <= 256 else np.int16


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
