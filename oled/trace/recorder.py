"""Recording a trace: a thin wrapper around the expert manager.

Off by default: nothing is recorded unless `record()` (or `oled trace`) puts the recorder in place. The routing is
kept on the device during a forward and moved to the host in one transfer per forward, like the manager's static
path, so recording adds no host round trip per layer. With predictions, each MoE layer's input also goes through
the routers of the PREDICTION_DISTANCES MoE layers after it (while recording only: the live manager runs the next
layer's router alone, and only for policies that want it).
"""
from __future__ import annotations

import numpy as np
import torch

from ..decoding.loop import generate
from .format import (BEGIN, END, EVENT, FORMAT, KINDS, PREDICTION_DISTANCES, REQUEST, RUN, Trace, expert_id_dtype,
                     pred_arrays)


class TraceRecorder:
    """Stands in for the ExpertManager (as the loop's manager and as every MoE block's `experts`): records each
    call, then forwards it. Any other attribute is the manager's."""

    def __init__(self, manager, predictions: bool = True):
        self.manager = manager
        self.layers = list(manager.layers)
        self.predictions = predictions
        self.distances = min(PREDICTION_DISTANCES, len(self.layers) - 1) if predictions else 0
        self.ops: list[tuple[int, int]] = []
        self.fwd_kind: list[int] = []
        self.fwd_start: list[int] = []
        self.fwd_tokens: list[int] = []
        self.fwd_block_start: list[int] = []
        self.fwd_cpu_scale: list[float] = []
        self.run_layer: list[int] = []
        self.run_forward: list[int] = []
        self.run_rows: list[int] = [0]
        slots = max(self.distances, 1)       # distance 1's arrays exist (empty) without predictions too
        self.pred_rows: list[list[int]] = [[0] for _ in range(slots)]            # per distance
        self.ids_chunks: list[np.ndarray] = []
        self.w_chunks: list[np.ndarray] = []
        self.pred_chunks: list[list[np.ndarray]] = [[] for _ in range(slots)]
        self.events: list[tuple] = []
        self.requests: list[dict] = []
        self._pending: list[tuple] = []
        self._forward = -1

    def __getattr__(self, name):
        return getattr(self.__dict__["manager"], name)

    # ----------------------------------------------------------------------------------------- manager calls
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared=None) -> torch.Tensor:
        pos = self.layers.index(layer)
        ahead = self.layers[pos + 1: pos + 1 + self.distances]      # the MoE layers this input predicts
        preds = [self.manager.predictors[later](x, ahead=d)[0] for d, later in enumerate(ahead, 1)]
        self.ops.append((RUN, len(self.run_layer)))
        self.run_layer.append(layer)
        self.run_forward.append(self._forward)
        self._pending.append((ids, weights, preds + [None] * (len(self.pred_rows) - len(preds))))
        return self.manager.run(layer, x, ids, weights, shared)

    def begin_forward(self, info) -> None:
        self._flush()
        self._forward += 1
        self.ops.append((BEGIN, KINDS.index(info.kind)))
        self.fwd_kind.append(KINDS.index(info.kind))
        self.fwd_start.append(info.start)
        self.fwd_tokens.append(info.tokens)
        self.fwd_block_start.append(info.block_start)
        self.manager.begin_forward(info)
        self.fwd_cpu_scale.append(self.manager.residency.cpu_scale)     # chosen as the forward began

    def end_forward(self) -> None:
        self._flush()
        self.ops.append((END, 0))
        self.manager.end_forward()

    def on_iteration(self, event) -> None:
        self.ops.append((EVENT, len(self.events)))
        self.events.append((self._forward, event.block, event.step, event.iteration, event.block_done,
                            np.asarray(event.state, dtype=np.int8).copy(),
                            np.asarray(event.confidence, dtype=np.float32).copy(),
                            np.asarray(event.tokens, dtype=np.int32).copy()))
        self.manager.on_iteration(event)

    def on_request_start(self) -> None:
        self.ops.append((REQUEST, len(self.requests) - 1))
        self.manager.on_request_start()

    # ------------------------------------------------------------------------------------------ bookkeeping
    def begin_request(self, prompt_id: str, prompt_ids: list[int]) -> None:
        self.requests.append({"id": prompt_id, "prompt_ids": list(prompt_ids), "output_ids": []})

    def end_request(self, output_ids: list[int]) -> None:
        self.requests[-1]["output_ids"] = list(output_ids)

    def _flush(self) -> None:
        """Move the current forward's routing to the host (one transfer per kind of tensor)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        ids_host = _to_host([p[0] for p in pending])
        w_host = _to_host([p[1].float() for p in pending])
        for ids, w in zip(ids_host, w_host):
            self.ids_chunks.append(np.asarray(ids, dtype=np.int16))
            self.w_chunks.append(np.asarray(w, dtype=np.float32))
            self.run_rows.append(self.run_rows[-1] + ids.shape[0])
        for d, (rows, chunks) in enumerate(zip(self.pred_rows, self.pred_chunks)):
            host = iter(_to_host([p[2][d] for p in pending if p[2][d] is not None]))
            for _, _, preds in pending:
                if preds[d] is None:
                    rows.append(rows[-1])
                    continue
                chunks.append(np.asarray(next(host), dtype=np.int16))
                rows.append(rows[-1] + chunks[-1].shape[0])

    def to_trace(self, header: dict) -> Trace:
        self._flush()
        k = header["model"]["top_k"]

        def cat(chunks, dtype, width):
            return np.concatenate(chunks).astype(dtype) if chunks else np.zeros((0, width), dtype=dtype)

        def offsets(lists):
            return np.cumsum([0] + [len(x) for x in lists]).astype(np.int64)

        ev = self.events
        header = dict(header, format=FORMAT, predictions=self.predictions, prediction_distances=self.distances,
                      requests=[r["id"] for r in self.requests])
        id_type = expert_id_dtype(header["model"]["num_experts"])
        preds = {}
        for d, (rows, chunks) in enumerate(zip(self.pred_rows, self.pred_chunks), 1):
            offset_name, ids_name = pred_arrays(d)
            preds[offset_name], preds[ids_name] = np.asarray(rows, dtype=np.int64), cat(chunks, id_type, k)
        return Trace(
            header=header,
            ops=np.asarray(self.ops, dtype=np.int32).reshape(-1, 2),
            fwd_kind=np.asarray(self.fwd_kind, dtype=np.int8),
            fwd_start=np.asarray(self.fwd_start, dtype=np.int32),
            fwd_tokens=np.asarray(self.fwd_tokens, dtype=np.int32),
            fwd_block_start=np.asarray(self.fwd_block_start, dtype=np.int32),
            fwd_cpu_scale=np.asarray(self.fwd_cpu_scale, dtype=np.float64),
            run_layer=np.asarray(self.run_layer, dtype=np.int32),
            run_forward=np.asarray(self.run_forward, dtype=np.int32),
            run_offset=np.asarray(self.run_rows, dtype=np.int64),
            ids=cat(self.ids_chunks, np.int16, k),
            weights=cat(self.w_chunks, np.float32, k),
            **preds,
            ev_forward=np.asarray([e[0] for e in ev], dtype=np.int32),
            ev_block=np.asarray([e[1] for e in ev], dtype=np.int32),
            ev_step=np.asarray([e[2] for e in ev], dtype=np.int32),
            ev_iteration=np.asarray([e[3] for e in ev], dtype=np.int32),
            ev_done=np.asarray([e[4] for e in ev], dtype=bool),
            ev_offset=offsets([e[5] for e in ev]),
            ev_state=np.concatenate([e[5] for e in ev]) if ev else np.zeros(0, np.int8),
            ev_conf=np.concatenate([e[6] for e in ev]) if ev else np.zeros(0, np.float32),
            ev_token=np.concatenate([e[7] for e in ev]) if ev else np.zeros(0, np.int32),
            req_prompt_offset=offsets([r["prompt_ids"] for r in self.requests]),
            req_prompt_ids=np.asarray([t for r in self.requests for t in r["prompt_ids"]], dtype=np.int32),
            req_output_offset=offsets([r["output_ids"] for r in self.requests]),
            req_output_ids=np.asarray([t for r in self.requests for t in r["output_ids"]], dtype=np.int32),
        )


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors to the host, in one transfer where they have one shape."""
    if tensors and len({tuple(t.shape) for t in tensors}) == 1:
        return list(torch.stack(tensors).cpu().numpy())
    return [t.cpu().numpy() for t in tensors]


def record(engine, prompts, params, *, predictions: bool = True, on_prompt=None) -> tuple[TraceRecorder, list]:
    """Run prompts [(id, token ids)] through the engine with a recorder in place; returns the recorder and the
    GenerationResults. The engine's manager is put back afterwards."""
    rec = TraceRecorder(engine.manager, predictions=predictions)
    results = []
    with engine.runner.borrowed(rec):
        for pid, ids in prompts:
            params.validate()
            rec.begin_request(pid, ids)
            res = generate(engine.runner, ids, params, timer=engine.timer)
            rec.end_request(res.token_ids)
            results.append(res)
            if on_prompt is not None:
                on_prompt(pid, res)
    return rec, results
