"""CUDA graphs for the forwards that repeat, so that the host stops bounding the decode.

A forward's shapes depend only on its token count, its key length (padded to a bucket, KVCache.key_len) and the rows
it wants logits for: positions and the visible key end are device tensors (MoEDiffusionLM.run), so every block's
iterations share one graph, and so do the blocks' first forwards. With every expert resident (`full`, or any policy
at a budget that holds them all) a forward needs no host decision, so it is captured once and replayed: one launch
instead of tens of kernel launches per layer issued from Python, whose host time otherwise bounds the decode.

An offloaded forward needs the host twice per MoE layer: to decide (the routing picks copies and CPU jobs) and to
finish (further waves, prefetches, CPU results). With `segmented` the forward is captured as segments that end
where the runtime needs the host (runtime/backend.py LayerSegments): a replay runs a segment (attention, router,
the routing's read-back, the hits computed from the device slot map), the decisions eagerly while those hits run,
which write the first wave's slot per pair into a buffer the next segment reads, that segment (the loads' grouped
compute; skipped when the layer loads nothing), the finish eagerly, which writes its rows into the pair outputs,
and the next segment (the combine, the next attention, ...), and so on.

Steady-state iterations (logits for every token run) are captured at their first use, any other shape at its
second (a one-off shape would not repay its capture); captured shapes are replayed from then on. A replay runs the
very kernels the eager forward runs, on the same shapes, so its tokens are those of the eager path. A graph holds the
KV cache's addresses: the model runner (decoding/model_runner.py) owns the cache and keeps it across requests, and a
forward on another cache drops every graph.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import numpy as np
import torch

from ..runtime.backend import GraphHooks, LayerSegments
from .kv_cache import KVCache

log = logging.getLogger("oled")


class CudaGraphBackend:
    """Segments are torch.cuda.CUDAGraph captures sharing one memory pool per forward; captures run on a side stream
    (capture is not allowed on the default stream)."""
    needs_eager_first = True

    def __init__(self):
        self.stream = None

    @contextlib.contextmanager
    def capturing(self):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
            # cuBLAS creates its handles on first use, which a capture does not allow. The eager forward before the
            # first capture used to create them, but one whose GEMMs all ran Triton kernels and that computed no
            # logits (a short prompt's prefill with --fused-linear) never calls cuBLAS: a TTFT run failed
            # so. One small GEMM of each kind, eagerly, creates the cuBLAS and cuBLASLt handles.
            a = torch.ones(16, 16, device="cuda")
            torch.mm(a, a)
            torch.mm(a.bfloat16(), a.bfloat16())
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    @staticmethod
    def new_graph(share_with=None):
        return _CudaSegment(share_with)


class _CudaSegment:
    def __init__(self, share_with):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = share_with.graph.pool() if share_with is not None else None

    def begin(self):
        self.graph.capture_begin(pool=self.pool)

    def end(self):
        self.graph.capture_end()

    def replay(self):
        self.graph.replay()

    def release(self):
        self.graph.reset()


class ForwardGraphs:
    """Runs model forwards, replaying the captured graphs of a (tokens, key length, rows) shape seen before.

    The one-graph paths log each layer's routing on the device and read it back once per forward; a capture keeps
    the tensors it logged and hands them back after every replay (GraphHooks.replayed), so statistics are kept
    exactly as in an eager forward. The offloaded path keeps its statistics on the host as it runs, replay or not.
    """

    def __init__(self, model, hooks: GraphHooks, backend=None, max_graphs: int = 8, max_seen: int = 4096,
                 segmented: bool = False):
        self.model, self.hooks = model, hooks
        self.device = model.embed.weight.device
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.max_graphs, self.max_seen, self.segmented = max_graphs, max_seen, segmented
        self.graphs: OrderedDict[tuple, _Forward] = OrderedDict()
        self.seen: set[tuple] = set()
        self.kv: KVCache | None = None
        self.enabled = True
        # no capture before one eager forward where the backend needs it: cuBLAS creates its handles on first use,
        # which a capture does not allow (a short prompt's first forward is already a steady-state iteration)
        self.warmed = not getattr(self.backend, "needs_eager_first", False)
        self.captures = self.replays = 0

    def clear(self) -> None:
        for fwd in self.graphs.values():
            fwd.release()
        self.graphs.clear()
        self.seen.clear()

    def __call__(self, ids: torch.Tensor, start: int, kv: KVCache, kv_end: int, rows: slice | None,
                 block_length: int | None = None):
        """ids: on the host (the decoding loop's: a replay copies them to the device with the positions), or on the
        device."""
        if kv is not self.kv:                     # graphs hold the KV cache's addresses: another cache, none fit
            self.clear()
            self.kv = kv
        if not self.enabled or not self.warmed:
            self.warmed = True
            return self.model(ids.to(self.device), start, kv, kv_end, rows, block_length=block_length)
        # the block length is a constant of the captured mask (MoEDiffusionLM.attention_mask): part of the key; so is
        # the forward's path (a mapped forward is one segment, an offloaded one of the same shape is not)
        key = (ids.shape[0], kv.key_len(kv_end), None if rows is None else (rows.start, rows.stop, rows.step),
               block_length, self.hooks.path())
        fwd = self.graphs.get(key)
        if fwd is not None:
            self.graphs.move_to_end(key)
            fwd.set_inputs(ids, start, kv_end)
            out = fwd.replay(self.hooks)
            self.replays += 1
            return out
        if key not in self.seen and not _steady(rows):
            if len(self.seen) >= self.max_seen:
                self.seen.clear()
            self.seen.add(key)
            return self.model(ids.to(self.device), start, kv, kv_end, rows, block_length=block_length)
        return self._capture(key, ids, start, kv, kv_end, rows, block_length)

    def _capture(self, key, ids, start, kv, kv_end, rows, block_length):
        """Capture the forward segment by segment; each segment is replayed as soon as it is captured, so this
        forward's own result comes out of the graphs (and a host step in between sees real values)."""
        fwd = _Forward(self.backend, ids, start, kv_end, self.device)
        boundary = fwd.boundary(self.hooks.segments) if self.segmented else None
        try:
            with self.hooks.capture(boundary) as captured, self.backend.capturing():
                try:
                    fwd.begin_segment()
                    fwd.out = self.model.run(fwd.ids, fwd.positions, fwd.kv_end, kv, key[1], rows,
                                             block_length=block_length)
                    fwd.end_segment()
                except BaseException:
                    # end the capture on its own stream before leaving it: an open capture makes the stream
                    # switch back, and every later launch, fail ("operation not permitted when stream is
                    # capturing"), so the eager fallback below could not run
                    fwd.abort()
                    raise
        except RuntimeError as e:                 # e.g. an operation that syncs with the host: stay eager
            # (host steps that already ran keep their effects: a failure past the first MoE layer of a segmented
            # capture counts those layers' statistics twice for this one forward)
            fwd.abort()
            self.enabled = False
            log.warning("CUDA graph capture failed, forwards run eagerly from now on: %s", str(e).splitlines()[0])
            return self.model(ids.to(self.device), start, kv, kv_end, rows, block_length=block_length)
        fwd.routing = captured.routing            # handed back after every replay
        if len(self.graphs) >= self.max_graphs:
            _, old = self.graphs.popitem(last=False)
            old.release()
        self.graphs[key] = fwd
        self.captures += 1
        self.replays += 1
        return fwd.out


def _steady(rows: slice | None) -> bool:
    """A forward that wants the logits of every token it runs from the first is a block's steady-state iteration,
    which repeats until the block is done: captured at its first use. Forwards that also run tokens they need no
    logits for (a finished block's K/V written with the next block's first iteration, a refresh of the whole
    canvas) happen once per block: captured when their shape comes back (usually the next block), so a one-off
    shape (a prompt's prefill) does not pay for a capture."""
    return rows is not None and (rows.start or 0) == 0


class _Decide:
    """Host step one of an offloaded layer: the decisions once the segment has read the routing back and
    computed the hits; the first wave's slot per pair goes into `load_slots`, which the next segment reads. That
    segment is skipped when the wave has nothing to compute."""
    __slots__ = ("layer", "x", "load_slots", "work")

    def __init__(self, layer, x, ids):
        self.layer, self.x, self.work = layer, x, None
        self.load_slots = torch.empty(ids.numel(), dtype=torch.int64, device=ids.device)

    def run(self, segments: LayerSegments) -> bool:
        self.work = segments.decide(self.layer, self.x, self.load_slots)
        return self.work.loads_first


class _Finish:
    """Host step two: the layer's finish, writing into the pair outputs."""
    __slots__ = ("decide", "y_pairs")

    def __init__(self, decide: _Decide, y_pairs):
        self.decide, self.y_pairs = decide, y_pairs

    def run(self, segments: LayerSegments) -> bool:
        segments.finish(self.decide.work, self.decide.x, self.y_pairs)
        self.decide.work = None
        return True


class _Forward:
    """One captured forward: segments in order, each followed by the host step that ended it (None for the last),
    and the static inputs they read (token ids, positions, key end), refilled before every replay."""

    def __init__(self, backend, ids, start: int, kv_end: int, device):
        T = ids.shape[0]
        self.backend = backend
        # the static inputs in one tensor (ids, positions, key end), so that one copy from the host refills them
        self.inputs = torch.empty(2 * T + 1, dtype=torch.int64, device=device)
        self.ids, self.positions, self.kv_end = self.inputs[:T], self.inputs[T: 2 * T], self.inputs[2 * T]
        # two pinned host copies used in turn, each reused once the copy out of it is done (a forward of the same
        # shape may follow before the host waits on anything, e.g. a long prompt's prefill chunks)
        cuda = self.inputs.is_cuda
        self._staging = [torch.empty(2 * T + 1, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._copied: list = [None, None]
        self._turn = 0
        self.set_inputs(ids, start, kv_end)
        self.segments: list = []
        self.steps: list[_Decide | _Finish | None] = []
        self.out = None
        self.routing: list = []
        self._open = None

    def set_inputs(self, ids, start: int, kv_end: int) -> None:
        """ids, positions and the key end written on the host and copied to the device at once (instead of a copy,
        an arange and a fill, launches the GPU idled between). ids come from the host (the decoding loop's); a
        device tensor is read back first."""
        T = self.ids.shape[0]
        turn = self._turn
        self._turn ^= 1
        staging, copied = self._staging[turn], self._copied[turn]
        if copied is not None:
            copied.synchronize()
        host = staging.numpy()
        host[T: 2 * T] = np.arange(start, start + T)
        host[2 * T] = kv_end
        host[:T] = ids.cpu().numpy()
        self.inputs.copy_(staging, non_blocking=True)
        if self.inputs.is_cuda:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()

    def begin_segment(self) -> None:
        seg = self.backend.new_graph(share_with=self.segments[0] if self.segments else None)
        seg.begin()
        self._open = seg

    def end_segment(self) -> None:
        seg, self._open = self._open, None
        seg.end()
        self.segments.append(seg)
        self.steps.append(None)
        seg.replay()

    def boundary(self, segments: LayerSegments):
        def host_steps(layer, x, ids, weights, shared=None):
            # The segment so far issues this layer's routing read-back and computes its hits; it is captured and
            # replayed, so the host step sees real values. The decisions run eagerly (their slot buffer is
            # allocated outside any capture, so no segment's memory pool owns it); the first wave's loads are a
            # segment of their own (captured even when this forward loads nothing: a later replay may); the finish
            # runs eagerly on the pair outputs; the combine opens the next segment. The shared expert is in the first
            # segment, with or behind the hits: the GPU computes it while the host decides.
            y_pairs, shared_out = segments.begin(layer, x, ids, weights, shared)
            self.end_segment()
            decide = self.steps[-1] = _Decide(layer, x, ids)
            if not decide.run(segments):
                decide.load_slots.fill_(-1)     # the capture runs the segment: with nothing to compute in it
            self.begin_segment()
            segments.load_wave(layer, x, decide.load_slots, y_pairs)
            self.end_segment()
            finish = self.steps[-1] = _Finish(decide, y_pairs)
            finish.run(segments)
            self.begin_segment()
            return segments.combine(y_pairs, weights, shared_out)
        return host_steps

    @torch.inference_mode()
    def replay(self, hooks: GraphHooks):
        run = True
        for seg, step in zip(self.segments, self.steps):
            if run:                 # a segment runs unless the host step before it says it has nothing to do
                seg.replay()
            run = step.run(hooks.segments) if step is not None else True
        hooks.replayed(self.routing)
        return self.out

    def abort(self) -> None:
        if self._open is not None:
            with contextlib.suppress(RuntimeError):
                self._open.end()
            self._open = None
        self.release()

    def release(self) -> None:
        for seg in self.segments:
            seg.release()
        self.segments.clear()
