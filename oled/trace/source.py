"""A trace's routing and commits replayed on real weights (`oled bench --routing TRACE`).

A model with random weights routes unlike a trained one; a small trained model routes like one but its experts are
too small for offloading to cost anything. This joins the two: the routing decisions of a trained model (a trace)
drive a model with real-size experts. The MoE layers still run their router (its cost is real) and then take the
recorded ids and weights instead (`routing`); the decoding loop still runs the LM head and then commits the recorded
tokens with the recorded confidences (`iteration`). Every expert is computed on the real weights, so the bytes moved,
the CPU work and the GPU work are real, and every policy sees the very same routing and the same iterations.

The recorded routing of the whole trace is moved to the device once. Before each forward `begin_forward` copies that
forward's ids and weights (every MoE layer) into fixed buffers, and each layer reads its rows from them, so a
captured CUDA graph replays with the current forward's routing. Any divergence from the trace (a forward of another
shape, an iteration the trace does not have, other output tokens) raises TraceMismatch at once.
"""
from __future__ import annotations

import numpy as np
import torch

from ..decoding.params import DecodeParams
from ..policies.contract import ForwardInfo, IterationEvent
from .format import KINDS, Trace, pred_arrays


class TraceMismatch(ValueError):
    """The trace cannot drive this model, or the run left the recorded path."""


def check_compatible(trace: Trace, config) -> None:
    """One line naming the first difference between the trace's model and `config` that a replay cannot bridge."""
    m = trace.header["model"]
    name = m.get("name", "the trace's model")
    mine = (len(config.moe_layers), config.num_experts, config.top_k)
    theirs = (len(m["moe_layers"]), m["num_experts"], m["top_k"])
    if mine != theirs:
        raise TraceMismatch(f"the trace's routing ({name}: {theirs[0]} MoE layers x {theirs[1]} experts, top-"
                            f"{theirs[2]}) does not fit this model ({mine[0]} MoE layers x {mine[1]} experts, "
                            f"top-{mine[2]})")
    for key in ("vocab_size", "mask_token_id", "eos_token_id"):
        if key not in m:
            raise TraceMismatch(f"the trace does not record the model's {key} (recorded by an older oled): "
                                f"record it again with `oled trace`")
    if trace.ev_token is None:
        raise TraceMismatch("the trace does not record the committed tokens (recorded by an older oled): record it "
                            "again with `oled trace`")
    if m["vocab_size"] > config.vocab_size:
        raise TraceMismatch(f"the trace's vocabulary ({m['vocab_size']} tokens) is larger than this model's "
                            f"({config.vocab_size})")
    if bool(m.get("block_causal", config.block_causal)) != config.block_causal:
        kind = {True: "block-causal (LLaDA2)", False: "bidirectional (LLaDA)"}
        raise TraceMismatch(f"the trace was decoded {kind[bool(m['block_causal'])]}, this model decodes "
                            f"{kind[config.block_causal]}: their procedures differ")


class TraceSource:
    """Routing source for the MoE layers and commit source for the decoding loop, from one trace."""

    def __init__(self, trace: Trace, config, device):
        check_compatible(trace, config)
        self.trace = t = trace
        self.layers = list(config.moe_layers)
        self.position = {layer: p for p, layer in enumerate(self.layers)}
        L, k = len(self.layers), config.top_k
        self.L, self.k = L, k
        # Each forward's runs are its MoE layers in order, one row per token: then its routing is one slice.
        runs_per_forward = np.bincount(t.run_forward, minlength=len(t.fwd_kind))
        rows = np.diff(t.run_offset)
        expected_layers = np.tile(np.asarray(t.layers, dtype=np.int64), len(t.fwd_kind))
        if (np.any(runs_per_forward != L) or np.any(np.diff(t.run_forward) < 0)
                or not np.array_equal(t.run_layer.astype(np.int64), expected_layers)
                or not np.array_equal(rows, t.fwd_tokens[t.run_forward])):
            raise TraceMismatch("the trace's forwards do not each run every MoE layer once, in order, over all "
                                "their tokens")
        self.first_run = np.arange(len(t.fwd_kind)) * L
        # request r: forwards [fwd_begin[r], fwd_begin[r+1]), events [ev_begin[r], ev_begin[r+1])
        Q = t.num_requests
        self.fwd_begin = np.searchsorted(t.fwd_request, np.arange(Q + 1))
        ev_request = t.fwd_request[t.ev_forward] if len(t.ev_forward) else np.zeros(0, np.int32)
        self.ev_begin = np.searchsorted(ev_request, np.arange(Q + 1))
        # the trace's special tokens become this model's
        m = t.header["model"]
        self._special = {int(m["mask_token_id"]): config.mask_token_id, int(m["eos_token_id"]): config.eos_token_id}
        used = np.unique(np.concatenate([t.req_prompt_ids, t.req_output_ids, t.ev_token]).astype(np.int64))
        clash = np.setdiff1d(np.intersect1d(used, [config.mask_token_id, config.eos_token_id]),
                             list(self._special))
        if clash.size:
            raise TraceMismatch(f"the trace uses token {int(clash[0])}, which is this model's mask or EOS token")
        # the whole trace's routing on the device, and the per-forward buffers the layers read
        self.device = torch.device(device)
        self.ids_all = torch.from_numpy(t.ids.astype(np.int64)).to(self.device)
        self.weights_all = torch.from_numpy(t.weights.astype(np.float32)).to(self.device)
        T = int(t.fwd_tokens.max()) if len(t.fwd_tokens) else 1
        self.ids_buf = torch.zeros(L, T, k, dtype=torch.int64, device=self.device)
        self.weights_buf = torch.zeros(L, T, k, dtype=torch.float32, device=self.device)
        # predictions d MoE layers ahead: pred_buf[d][p] is layer p's, from the input of layer p - d
        self.pred_all: dict[int, torch.Tensor] = {}
        self.pred_buf: dict[int, torch.Tensor] = {}
        run_position = np.tile(np.arange(L), len(t.fwd_kind))      # runs are every layer in order (checked above)
        for d in range(1, min(t.prediction_distances, L - 1) + 1):
            offset_name, ids_name = pred_arrays(d)
            if not np.array_equal(np.diff(getattr(t, offset_name)), np.where(run_position + d < L, rows, 0)):
                raise TraceMismatch(f"the trace's routing predicted {d} MoE layers ahead does not cover every layer "
                                    f"that has one that far ahead")
            self.pred_all[d] = torch.from_numpy(getattr(t, ids_name).astype(np.int64)).to(self.device)
            self.pred_buf[d] = torch.zeros(L, T, k, dtype=torch.int64, device=self.device)
        self.predictions = 1 in self.pred_all
        self._request = self._forward = self._event = -1
        self._tokens = 0

    # ------------------------------------------------------------------------------------------ requests
    @property
    def num_requests(self) -> int:
        return self.trace.num_requests

    def decode_params(self) -> DecodeParams:
        """The decoding settings the trace was recorded with (a replay must decode the same way)."""
        fields = DecodeParams.__dataclass_fields__
        d = {k: v for k, v in self.trace.header["decode"].items() if k in fields and k != "stop"}
        return DecodeParams(**d)

    def translate(self, tokens) -> list[int]:
        return [self._special.get(int(x), int(x)) for x in tokens]

    def prompt_ids(self, r: int) -> list[int]:
        return self.translate(self.trace.prompt_ids(r))

    def output_ids(self, r: int) -> list[int]:
        return self.translate(self.trace.output_ids(r))

    def begin_request(self, r: int) -> None:
        if not 0 <= r < self.num_requests:
            raise TraceMismatch(f"the trace has {self.num_requests} requests, not {r + 1}")
        self._request = r
        self._forward = int(self.fwd_begin[r]) - 1
        self._event = int(self.ev_begin[r]) - 1

    def end_request(self, token_ids: list[int]) -> None:
        """The run must have used every forward and iteration of the request and produced its tokens."""
        r = self._request
        if self._forward + 1 != self.fwd_begin[r + 1] or self._event + 1 != self.ev_begin[r + 1]:
            raise TraceMismatch(f"request {r} ended after {self._forward + 1 - self.fwd_begin[r]} of its "
                                f"{self.fwd_begin[r + 1] - self.fwd_begin[r]} recorded forwards")
        if list(token_ids) != self.output_ids(r):
            raise TraceMismatch(f"request {r} produced other tokens than the trace records")

    # ------------------------------------------------------------------------------------------ forwards
    def begin_forward(self, info: ForwardInfo) -> None:
        """Check the forward against the trace's next one and stage its routing for the layers."""
        t, f = self.trace, self._forward + 1
        if self._request < 0:
            raise TraceMismatch("begin_request() was not called before the first forward")
        if f >= self.fwd_begin[self._request + 1]:
            raise TraceMismatch(f"request {self._request} runs more forwards than the trace records")
        recorded = (KINDS[t.fwd_kind[f]], int(t.fwd_start[f]), int(t.fwd_tokens[f]))
        if recorded != (info.kind, info.start, info.tokens):
            raise TraceMismatch(f"request {self._request}, forward {f - self.fwd_begin[self._request]}: the trace "
                                f"has a {recorded[0]} of {recorded[2]} tokens at {recorded[1]}, this run a "
                                f"{info.kind} of {info.tokens} tokens at {info.start}")
        self._forward, self._tokens = f, info.tokens
        T, L, k = info.tokens, self.L, self.k
        a = int(t.run_offset[self.first_run[f]])
        self.ids_buf[:, :T].copy_(self.ids_all[a:a + L * T].view(L, T, k), non_blocking=True)
        self.weights_buf[:, :T].copy_(self.weights_all[a:a + L * T].view(L, T, k), non_blocking=True)
        for d, pred in self.pred_all.items():
            p = int(getattr(t, pred_arrays(d)[0])[self.first_run[f]])
            self.pred_buf[d][d:, :T].copy_(pred[p:p + (L - d) * T].view(L - d, T, k), non_blocking=True)

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor):
        """The MoE layer's routing: the recorded ids and weights of this forward (the router's are discarded)."""
        T = ids.shape[0]
        if T != self._tokens:
            raise TraceMismatch(f"layer {layer} routes {T} tokens; the trace's forward has {self._tokens}")
        p = self.position[layer]
        return self.ids_buf[p, :T], self.weights_buf[p, :T].to(weights.dtype)

    def predicted(self, layer: int, x: torch.Tensor, ahead: int = 1):
        """The routing of `layer` predicted from the input of the MoE layer `ahead` layers before it (`prefetch`
        policies see ahead=1): the recorded prediction (the layer's actual recorded routing if the trace has none
        that far ahead)."""
        p, T = self.position[layer], x.shape[0]
        return self.pred_buf.get(ahead, self.ids_buf)[p, :T], None

    # ------------------------------------------------------------------------------------------ iterations
    def iteration(self, block: int, step: int, window_start: int, block_start: int, masked: np.ndarray):
        """The recorded iteration of this block step: commit mask, tokens and confidences over the window
        [window_start, block end); `masked` is the window's mask state before it, which must be the trace's."""
        t, j = self.trace, self._event + 1
        if self._request < 0 or j >= self.ev_begin[self._request + 1]:
            raise TraceMismatch(f"request {self._request} runs more iterations than the trace records")
        if (int(t.ev_block[j]), int(t.ev_step[j]), int(t.ev_forward[j])) != (block, step, self._forward):
            raise TraceMismatch(f"request {self._request}: the run is at block {block} step {step}; the trace's next "
                                f"iteration is block {int(t.ev_block[j])} step {int(t.ev_step[j])}")
        if window_start != block_start:
            raise TraceMismatch("the run commits before its block (a prompt holding mask tokens): a trace records "
                                "only the block's own positions")
        a, b = int(t.ev_offset[j]), int(t.ev_offset[j + 1])
        state = t.ev_state[a:b]
        if len(state) != len(masked) or not np.array_equal(state != IterationEvent.DECODED, masked):
            raise TraceMismatch(f"request {self._request}, block {block} step {step}: the masked positions differ "
                                f"from the trace's")
        self._event = j
        commit = state == IterationEvent.COMMITTED
        tokens = np.asarray(self.translate(t.ev_token[a:b]), dtype=np.int64)
        return commit, tokens, t.ev_conf[a:b].astype(np.float64)
