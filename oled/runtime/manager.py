"""ExpertManager: runs a MoE layer's routed experts from the GPU expert cache, the copy engine and the CPU.

Per layer: learn the routing on the host (the one round trip offloading needs), ask the policy which misses to
load and which to compute on the CPU, issue the layer's copies together on the copy stream, start the CPU jobs,
run one grouped computation over the slots in use (waiting only for this layer's copies), and combine every
(token, expert) output in routing order, so the result does not depend on where an expert ran.
With a static all-resident policy (`full`) there is nothing to decide and no host round trip at all.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..config import CPU_WAKE_MODES
from ..policies.base import ForwardInfo, IterationEvent, Policy
from .budget import ExpertBudget
from .cost_model import CostModel
from .expert_cache import ExpertCache
from .grouped import grouped_swiglu
from .residency import LayerStep, Residency, Wave
from .stats import RunStats
from .store import ExpertStore
from .timer import SectionTimer


# How the CPU kernel's workers are ready for the engine's calls, one per layer with CPU work (EngineConfig.cpu_wake):
#   layer    woken when a layer's routing is read back, so that their wake-up overlaps the wait for the GPU, if the
#            layer had CPU work the last time it ran (waking them for nothing slows the main thread); they poll for
#            LAYER_HOLD_S, then sleep
#   forward  polling through each forward (at most FORWARD_HOLD_S, which bounds an exception mid-forward)
#   off      woken by each call
WAKE_MODES = CPU_WAKE_MODES
LAYER_HOLD_S = 0.001


def check_cpu_wake(mode: str) -> None:
    if mode not in WAKE_MODES:
        raise ValueError(f"cpu_wake must be one of {', '.join(WAKE_MODES)}, got {mode!r}")

FORWARD_HOLD_S = 1.0


class ExpertManager:
    def __init__(self, store: ExpertStore, budget: ExpertBudget, policy: Policy, device, cpu_kernel=None,
                 timer: SectionTimer | None = None, costs: CostModel | None = None, cpu_wake: str = WAKE_MODES[0]):
        self.store, self.policy, self.device = store, policy, torch.device(device)
        self.config = store.config
        self.layers = store.layers
        self.layer_pos = store.layer_pos
        self.hidden, self.inter = store.hidden, store.intermediate
        self.cache = ExpertCache(self.layers, budget, store.numel, store.dtype, self.device)
        self.stats = RunStats()
        self.timer = timer
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.layer_done: dict[int, torch.cuda.Event] = {}      # last compute that read a layer's slots
        self.pending_copy: dict[int, torch.cuda.Event] = {}    # slot -> copy event not yet waited for
        self.predictors: dict[int, object] = {}                # layer -> router of that layer (for prefetch)
        self.cpu_kernel = cpu_kernel
        self.costs = costs        # measured miss-service costs: each CPU job's predicted time is recorded beside its
                                  # measured time, so a run shows how well the model the planner relies on holds
        self.cpu_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oled-cpu") if cpu_kernel else None
        self._cpu_last_time: dict[int, bool] = {}           # layer -> it had CPU work the last time it ran
        check_cpu_wake(cpu_wake)
        self.cpu_wake = cpu_wake
        if policy.uses_cpu and cpu_kernel is None:
            raise ValueError(f"policy {policy.name!r} computes misses on the CPU but no CPU expert kernel was given")
        # Host-side decisions (slot tables, policy calls, statistics), shared with the trace replayer.
        self.residency = Residency(self.cache, policy, self.stats, num_experts=self.config.num_experts,
                                   top_k=self.config.top_k, expert_bytes=store.expert_bytes, costs=costs)
        self._place_initial()
        self.slot_lut = self.cache.slot_table(self.config.num_experts) if policy.static_full else None
        self._buffers: dict[str, torch.Tensor] = {}
        self._routing_log: list[tuple[int, torch.Tensor]] = []   # static path: routing kept on device until the
                                                                 # forward ends, then recorded in one transfer
        # Set while a segmented CUDA graph is captured (decoding/graphs.py): called instead of run_offloaded.
        self.host_boundary = None

    # ----------------------------------------------------------------------------------------------- placement
    def _place_initial(self) -> None:
        for layer, experts, slots in self.residency.place_initial():
            self._copy(layer, experts, slots, wait_layer=False)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self.pending_copy.clear()

    def _copy(self, layer: int, experts: list[int], slots: list[int], wait_layer: bool = True) -> None:
        """Copy experts' blobs into slots on the copy stream; one event covers the batch."""
        if not experts:
            return
        if not self.cuda:
            for e, s in zip(experts, slots):
                self.cache.pool[s].copy_(self.store.blob(layer, e))
            return
        with torch.cuda.stream(self.copy_stream):
            if wait_layer and layer in self.layer_done:   # a victim slot may still be read by an earlier compute
                self.copy_stream.wait_event(self.layer_done[layer])
            with self._section("h2d_copy"):               # events on the copy stream: the copy path's own time
                for e, s in zip(experts, slots):
                    self.cache.pool[s].copy_(self.store.blob(layer, e), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        for s in slots:
            self.pending_copy[s] = event

    # ------------------------------------------------------------------------------------------------- compute
    def _section(self, name: str):
        return self.timer(name) if self.timer is not None else _NULL

    def _wait_copies(self, slots: np.ndarray) -> None:
        if not self.pending_copy:
            return
        events = {id(ev): ev for s in slots.tolist() if (ev := self.pending_copy.pop(s, None)) is not None}
        if events:
            with self._section("copy_wait"):
                stream = torch.cuda.current_stream(self.device)
                for ev in events.values():
                    stream.wait_event(ev)

    def _grouped(self, layer, x, pair_slots, y_pairs, n_valid: int | None) -> None:
        """Grouped compute of the pairs with a slot (>= 0) into their rows of y_pairs. n_valid=None writes every row
        (rows of pairs without a slot get unspecified values: a static shape for graphs); otherwise only the
        n_valid rows of the served pairs, leaving the others as they are."""
        with self._section("gpu_experts"):
            k = pair_slots.shape[0] // x.shape[0]                 # pairs are token-major: T tokens x k experts
            pair_tokens = torch.arange(pair_slots.shape[0], device=x.device) // k
            base = self.layer_pos[layer] * self.cache.capacity
            order, y = grouped_swiglu(x, pair_tokens, pair_slots, self.cache.pool[base:base + self.cache.capacity],
                                      self.hidden, self.inter, slot_base=base)
            if n_valid is None or n_valid == pair_slots.shape[0]:
                y_pairs.index_copy_(0, order, y)
            else:
                y_pairs.index_copy_(0, order[:n_valid], y[:n_valid])

    def combine(self, y_pairs, weights):
        """sum_k weights[t, k] * y_pairs[t * k + k'], in fp32, in routing order."""
        T, k = weights.shape
        return (y_pairs.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(y_pairs.dtype)

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of one MoE layer: sum_k weights[t,k] * expert_{ids[t,k]}(x[t])."""
        if self.policy.static_full:
            pair_slots = self.slot_lut[self.layer_pos[layer]].index_select(0, ids.reshape(-1))
            y_pairs = self.first_wave(layer, x, pair_slots)      # every expert is resident: one wave
            self._routing_log.append((layer, ids))
            return self.combine(y_pairs, weights)
        if self.host_boundary is not None:        # a segmented graph capture ends its segment here
            return self.host_boundary(layer, x, ids, weights)
        return self.run_offloaded(layer, x, ids, weights)

    def run_offloaded(self, layer, x, ids, weights):
        """The offloaded path: a host round trip for the routing, then copies, CPU jobs and grouped compute. Three
        parts, so that a segmented CUDA graph (decoding/graphs.py) replays the device-only middle one: the host
        decisions, the first wave's grouped compute (every hit and the first loads), and the host's finish (further
        waves, prefetches, CPU results)."""
        work = self.begin_offloaded(layer, x, ids, weights)
        y_pairs = self.first_wave(layer, x, work.pair_slots)
        self.end_offloaded(work, x, y_pairs)
        return self.combine(y_pairs, weights)

    def begin_offloaded(self, layer, x, ids, weights, slots_out: torch.Tensor | None = None) -> "OffloadedLayer":
        """Host part one: read the routing back, let the policy decide, issue the first wave's copies and the CPU
        jobs, and put the first wave's slot of every pair (-1: served later) in a device tensor (slots_out if
        given: the buffer a replayed graph reads)."""
        if self.cpu_kernel is not None and self.cpu_wake == "layer" and self._cpu_last_time.get(layer, True):
            self.cpu_kernel.hold(LAYER_HOLD_S)                         # before the routing's round trip
        nxt = self.residency.next_layer(layer) if self.policy.wants_prediction else None
        # Prefetch: the next layer's router on this layer's input, brought back in the same round trip. Fetching it
        # after this layer's experts were launched would make the host wait for them (an in-order stream), so the
        # prefetch copies could not overlap this layer's compute.
        ids_next = self.predictors[nxt](x)[0] if nxt is not None else None
        ids_h, weights_h, predicted = self._read_routing(ids, weights, ids_next)   # the host round trip
        flat = ids_h.reshape(-1)
        step = self.residency.begin_layer(layer, ids_h, weights_h, predicted)
        cpu = step.decision.cpu
        self._cpu_last_time[layer] = bool(cpu)
        cpu_job = self._start_cpu(layer, x, flat, cpu, copying=bool(step.decision.load)) if cpu else None
        # Waves: hits plus as many loads as the layer's slots hold; more loads than slots run in further waves.
        waves = self.residency.waves(step)
        slots_np, _ = self._issue_wave(layer, flat, next(waves))
        pair_slots = torch.from_numpy(slots_np).to(x.device, non_blocking=True)
        if slots_out is not None:
            pair_slots = slots_out.copy_(pair_slots)
        return OffloadedLayer(layer, flat, step, waves, cpu_job, pair_slots)

    def _read_routing(self, ids, weights, ids_next):
        """The layer's routing (and the next layer's predicted ids) on the host: copies into pinned buffers and one
        wait for them. Returns fresh arrays (a policy may keep them)."""
        tensors = [ids, weights.float()] + ([ids_next] if ids_next is not None else [])
        if not self.cuda:
            host = [t.numpy().copy() for t in tensors]
        else:
            bufs = [self._staging(f"routing{i}", t.shape, t.dtype).copy_(t, non_blocking=True)
                    for i, t in enumerate(tensors)]
            torch.cuda.current_stream(self.device).synchronize()
            host = [b.numpy().copy() for b in bufs]
        return host[0], host[1], (host[2] if ids_next is not None else None)

    def first_wave(self, layer, x, pair_slots) -> torch.Tensor:
        """Device part: the first wave's grouped compute over the layer's slots, one output row per (token, expert)
        pair. Rows of pairs served later (slot -1) are left unspecified here and written by end_offloaded; the
        kernels and shapes do not depend on the routing, so a graph replays them."""
        y_pairs = torch.empty(pair_slots.shape[0], self.hidden, dtype=x.dtype, device=x.device)
        self._grouped(layer, x, pair_slots, y_pairs, n_valid=None)
        return y_pairs

    def end_offloaded(self, work: "OffloadedLayer", x, y_pairs) -> None:
        """Host part two: further waves (eagerly, into y_pairs), prefetches for the next layer, statistics, and the
        CPU jobs' results."""
        self._mark_layer_done(work.layer)
        for wave in work.waves:
            slots_np, n_valid = self._issue_wave(work.layer, work.flat, wave)
            if n_valid:
                pair_slots = torch.from_numpy(slots_np).to(x.device, non_blocking=True)
                self._grouped(work.layer, x, pair_slots, y_pairs, n_valid)
                self._mark_layer_done(work.layer)
        nxt, wanted, slots = self.residency.prefetch(work.step)   # after this layer's copies: its misses go first
        if wanted:
            self._copy(nxt, wanted, slots)
        self.residency.end_layer(work.step)
        if work.cpu_job is not None:
            self._finish_cpu(work.cpu_job, y_pairs, work.step.rec)

    def _issue_wave(self, layer, flat, wave) -> tuple[np.ndarray, int]:
        """Copy a wave's loads and make the compute wait for them; returns each pair's slot in this wave (-1: not
        in it) and the number of pairs the wave serves."""
        self._copy(layer, wave.loads, wave.slots)
        slot_lut = np.full(self.config.num_experts, -1, dtype=np.int64)   # this wave's experts -> slots
        slot_of = self.cache.resident(layer)
        wave_experts = list(wave.experts)
        slot_lut[wave_experts] = [slot_of[e] for e in wave_experts]
        slots_np = slot_lut[flat]
        valid = slots_np >= 0
        if self.cuda:
            self._wait_copies(slots_np[valid])
        return slots_np, int(valid.sum())

    def _mark_layer_done(self, layer) -> None:
        """The last compute that reads this layer's slots, so that a copy evicting one of them waits for it."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.layer_done[layer] = done

    # --------------------------------------------------------------------------------------------------- CPU
    def _start_cpu(self, layer: int, x: torch.Tensor, flat: np.ndarray, cpu_experts: list[int], copying: bool):
        sel = np.isin(flat, cpu_experts)
        pair_idx = np.nonzero(sel)[0]
        pair_exp = flat[pair_idx]
        order = np.argsort(pair_exp, kind="stable")            # group pairs by expert, routing order inside
        pair_idx, pair_exp = pair_idx[order], pair_exp[order]
        k = flat.size // x.shape[0]                              # pairs are token-major: T tokens x k experts
        token_idx = torch.from_numpy(pair_idx // k)
        job_experts, starts = np.unique(pair_exp, return_index=True)
        offsets = torch.from_numpy(np.append(starts, len(pair_exp)).astype(np.int64))
        predicted = 0.0
        if self.costs is not None:
            predicted = self.costs.cpu_jobs_seconds(int(n) for n in np.diff(offsets.numpy()))
            predicted *= self.costs.cpu_slowdown_with_copies if copying else 1.0
        blobs = [self.store.blob(layer, int(e)) for e in job_experts]
        x_host = self._staging("x", x.shape, self.store.dtype)
        x_host.copy_(x)                                             # waits for x, the layer's input
        out = self._staging("out", (len(pair_idx), self.hidden), torch.float32)

        def work():      # the kernel's own time: what the cost model predicts (dispatch and GIL waits are not)
            return self.cpu_kernel.run(x_host, token_idx, offsets, blobs, self.inter, out)

        return self.cpu_pool.submit(work), torch.from_numpy(pair_idx), out, predicted

    def _staging(self, name: str, shape, dtype) -> torch.Tensor:
        """Reused host buffers for activations crossing PCIe (pinned on CUDA: no pageable copy in the hot path)."""
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self.cuda)
            self._buffers[name] = buf
        return buf[:numel].view(*shape)

    def _finish_cpu(self, job, y_pairs, rec) -> None:
        future, pair_idx, out, predicted = job
        with self._section("cpu_experts"):
            rec.cpu_s += future.result()
        rec.cpu_s_model += predicted
        y_pairs.index_copy_(0, pair_idx.to(y_pairs.device), out.to(y_pairs.device, y_pairs.dtype))

    # ------------------------------------------------------------------------------------------ loop events
    def begin_forward(self, info: ForwardInfo) -> None:
        self.residency.begin_forward(info)
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(FORWARD_HOLD_S)

    def routing_mark(self) -> int:
        return len(self._routing_log)

    def take_routing(self, mark: int) -> list[tuple[int, torch.Tensor]]:
        """Remove and return the routing logged since `mark` (a CUDA graph capture keeps it to hand back)."""
        taken = self._routing_log[mark:]
        del self._routing_log[mark:]
        return taken

    def log_routing(self, routing: list[tuple[int, torch.Tensor]]) -> None:
        """Routing produced by a graph replay: the same device tensors every replay, read by end_forward."""
        self._routing_log.extend(routing)

    def end_forward(self) -> None:
        """Record the static path's routing (one device-to-host transfer per forward)."""
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(0.0)
        if not self._routing_log:
            return
        layers = [layer for layer, _ in self._routing_log]
        host = torch.stack([ids for _, ids in self._routing_log]).cpu().numpy()
        self._routing_log.clear()
        for layer, ids in zip(layers, host):
            self.residency.record_static(layer, ids)

    def on_iteration(self, event: IterationEvent) -> None:
        self.policy.on_iteration(event)

    def on_request_start(self) -> None:
        self.policy.on_request_start()

    def close(self) -> None:
        if self.cpu_pool is not None:
            self.cpu_pool.shutdown(wait=True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()


@dataclass
class OffloadedLayer:
    """What the host part one of an offloaded layer leaves for part two."""
    layer: int
    flat: np.ndarray            # routed expert ids, token-major [T*k]
    step: LayerStep
    waves: Iterator[Wave]       # the waves after the first
    cpu_job: tuple | None
    pair_slots: torch.Tensor    # first wave's slot per pair, on the device
