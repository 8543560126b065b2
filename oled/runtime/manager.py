"""ExpertManager: runs a MoE layer's routed experts from the GPU expert cache, the copy engine and the CPU.

Per layer: issue the routing's read-back and, without waiting for the host, compute every pair whose expert the
device slot map holds (the hits); meanwhile the host learns the routing, asks the policy which misses to load and
which to compute on the CPU, issues the layer's copies together on the copy stream and starts the CPU jobs; then
one grouped computation over the loaded slots (waiting only for this layer's copies), and the combine of every
(token, expert) output in routing order, so the result does not depend on where an expert ran. The host's
decisions overlap the hits' compute instead of holding the GPU idle.
With every expert resident (`full`, or any policy at a budget that holds them all) there is nothing to decide and
no host round trip at all. With mapped misses (run_mapped) a denoising iteration has none either: the fused kernels
read its misses from the pinned store, and the policy's decisions, taken behind the GPU, load for the next forwards.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..config import CPU_WAKE_MODES
from ..policies.base import ForwardInfo, IterationEvent, Policy
from .budget import ExpertBudget
from .cost_model import CostModel
from .cpu_feedback import CpuCostFeedback
from .cpu_share import ShareHold
from .expert_cache import ExpertCache
from .grouped import grouped_swiglu
from .residency import LayerStep, Residency, Wave
from .stats import RunStats
from .store import ExpertStore
from .timer import SectionTimer


# How the CPU kernel's workers are ready for the engine's calls, one per layer with CPU work (EngineConfig.cpu_wake):
#   layer    woken when a layer's routing is read back, so that their wake-up overlaps the wait for the GPU, if the
#            layer had CPU work the last time it ran with as many rows (waking them for nothing slows the main
#            thread; a block's first forward carries the previous block's rows too, and needs more experts than the
#            block's other iterations); they poll for LAYER_HOLD_S, then sleep
#   forward  polling through each forward (at most FORWARD_HOLD_S, which bounds an exception mid-forward)
#   off      woken by each call
#   auto     layer when the model runs on a CUDA device, off when it runs on the CPU: there the main thread's own
#            compute needs the cores the polling workers would take, and there is no GPU wait for their wake-up to
#            overlap (on a 2-core machine with both cores busy, layer made the README's main job at 40 % 2.0-2.1 x
#            slower than idle, off 0.9-1.6 x; BENCHMARKS.md section 9)
WAKE_MODES = CPU_WAKE_MODES
LAYER_HOLD_S = 0.001
# A mapped forward's routing buffer before the kernel's store: no id's half is -1, and a weight only as one NaN
MAPPED_UNSET = -1


def check_cpu_wake(mode: str) -> None:
    if mode not in WAKE_MODES:
        raise ValueError(f"cpu_wake must be one of {', '.join(WAKE_MODES)}, got {mode!r}")

FORWARD_HOLD_S = 1.0


class _Forked:
    """A shared expert's output computed on a side stream: called as the shared expert (on x, which it already
    read), the current stream waits for the side's work and gets the output. No record_stream is needed: that wait
    orders every later use and reuse of x, of the output and of their memory after the side's work."""

    def __init__(self, out: torch.Tensor, stream):
        self.out, self.stream = out, stream

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda.current_stream(self.out.device).wait_stream(self.stream)
        return self.out


class ExpertManager:
    def __init__(self, store: ExpertStore, budget: ExpertBudget, policy: Policy, device, cpu_kernel=None,
                 timer: SectionTimer | None = None, costs: CostModel | None = None, cpu_wake: str = "auto",
                 cpu_cost_feedback: bool = False, fused_moe: bool = False, mapped_misses: bool = False,
                 capture_slots: int = 0, shared_stream: bool = False, shared_in_moe: bool = False,
                 cpu_share: bool = False):
        self.store, self.policy, self.device = store, policy, torch.device(device)
        self.config = store.config
        self.layers = store.layers
        self.layer_pos = store.layer_pos
        self.hidden, self.inter = store.hidden, store.intermediate
        self.cache = ExpertCache(self.layers, budget, store.numel, store.dtype, self.device,
                                 self.config.num_experts)
        self.stats = RunStats()
        self.timer = timer
        self.cuda = self.device.type == "cuda"
        # EngineConfig.fused_moe: the Triton kernels over the slot pool (oled/kernels/triton_moe.py) instead of
        # grouped_swiglu; they write the served pairs' rows only
        self.fused_swiglu = self.fused_combine = None
        self.fused_swiglu_rows = 0
        if fused_moe:
            from ..kernels.triton_moe import combine_pairs, fused_swiglu_pairs, mapped_rows
            self.fused_swiglu, self.fused_combine = fused_swiglu_pairs, combine_pairs
            self.fused_swiglu_rows = mapped_rows(True)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # EngineConfig.shared_stream: the shared expert reads only the layer's input, so on the one-graph paths it runs
        # on a second stream beside the router and the routed experts (a fork and a join a layer, which a graph
        # captures; shared_ahead)
        self.shared_stream = torch.cuda.Stream(self.device) if self.cuda and shared_stream else None
        # EngineConfig.shared_in_moe: the fused MoE kernels compute each layer's shared expert as one more expert of
        # every token, from its blob (layer -> blob, given by the model runner: use_shared_blob), in the launches of
        # the layer's hits, on every path: no GEMMs, activation or stream of its own
        self.shared_in_moe = bool(shared_in_moe) and self.fused_swiglu is not None
        self.shared_blobs: dict[int, torch.Tensor] = {}
        self.layer_done: dict[int, torch.cuda.Event] = {}      # last compute that read a layer's slots
        self.pending_copy: dict[int, torch.cuda.Event] = {}    # slot -> copy event not yet waited for
        self._last_copy: torch.cuda.Event | None = None        # the copy stream's last event: covers every copy
        self.predictors: dict[int, object] = {}                # layer -> router of that layer (for prefetch)
        self.cpu_kernel = cpu_kernel
        self.costs = costs        # measured miss-service costs: each CPU job's predicted time is recorded beside its
                                  # measured time, so a run shows how well the model the planner relies on holds
        # each CPU job's time from submission to result against its predicted time: the planner's CPU terms follow
        # what the jobs take in the engine (EngineConfig.cpu_cost_feedback)
        self.cpu_feedback = CpuCostFeedback() if cpu_cost_feedback and cpu_kernel and costs is not None else None
        self._cpu_last_time: dict[tuple[int, int], bool] = {}   # (layer, rows) -> it had CPU work the last time
        check_cpu_wake(cpu_wake)
        self.cpu_wake = ("layer" if self.cuda else "off") if cpu_wake == "auto" else cpu_wake
        if policy.uses_cpu and cpu_kernel is None:
            raise ValueError(f"policy {policy.name!r} computes misses on the CPU but no CPU expert kernel was given")
        # Host-side decisions (slot tables, policy calls, statistics), shared with the trace replayer.
        self.residency = Residency(self.cache, policy, self.stats, num_experts=self.config.num_experts,
                                   top_k=self.config.top_k, expert_bytes=store.expert_bytes, costs=costs,
                                   mapped_rows=self.fused_swiglu_rows if mapped_misses else 0,
                                   capture_slots=capture_slots if mapped_misses else 0,
                                   cpu_share=cpu_share and mapped_misses and cpu_kernel is not None)
        self._slots_changed: set[int] = set()     # layers whose residency or readiness changed since their row of
                                                  # the device slot map was last written
        self._place_initial()
        self.all_resident = self.residency.all_resident     # the forward needs no host step: one graph
        # EngineConfig.mapped_misses: a denoising iteration's misses are read by the fused kernels from the pinned
        # store (mapped, over PCIe) inside the forward, so it needs no host step either (which forwards:
        # Residency.takes_mapped_path); the policy learns each layer's routing once the forward is queued and its
        # loads fill slots for the next forwards (run_mapped). No miss is computed on the CPU: on the host round
        # trip (prefill, cache fills) the misses a policy sends there are read from host memory by the first wave.
        self.mapped = bool(mapped_misses) and not self.all_resident
        if self.mapped and self.fused_swiglu is None:
            raise ValueError("mapped misses are read by the fused MoE kernels: they need --fused-moe (Triton)")
        if self.mapped and self.cuda and not store.pinned:
            raise ValueError("mapped misses read the expert store over PCIe: it must be pinned (drop --no-pin)")
        self._mapped_now = False                  # this forward takes the mapped path (begin_forward)
        self._prepared = False                    # the next forward's device state is set for the mapped path
        # EngineConfig.capture_slots: on the mapped path the kernels write the misses they read from host memory
        # into the layer's armed slots (Residency.arm_capture: free ones, then its next victims'), so a kept miss
        # crosses PCIe once. The capture table: per layer, the slots a mapped forward may capture into (absolute,
        # -1: none).
        # EngineConfig.cpu_share: a mapped forward's layers give part of their misses to the CPU kernel, which computes
        # them while the GPU reads the rest, and the combine waits for its rows (runtime/cpu_share.py): the
        # alignment's rule over the table of Residency.cpu_share_table, the buffers of CpuShare per (layer, tokens)
        table = self.residency.cpu_share_table if self.mapped else None
        self.cpu_share = table is not None
        self._share_table = torch.tensor(table, dtype=torch.int32, device=self.device) if self.cpu_share else None
        self._shares: dict[tuple[int, int], object] = {}
        self._share_errors = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda) if self.cpu_share else None
        self._shared_now: dict[int, list[int]] = {}  # without CUDA: layer -> the CPU experts served inside run_mapped
        self._share_hold = ShareHold()
        capture = self.residency.capture_slots if self.mapped else 0
        E = self.config.num_experts
        # The device state a forward reads, in one tensor so that one copy writes it between forwards
        # (_write_device_state): per layer, the slot map (expert -> slot of the experts ready to compute, -1: not),
        # so that a layer's hits are computed without the host, then the capture table. The host keeps its mirror
        # (`_ready`, `_capture_host`: views of `_state_host`); between forwards it writes the whole state in one
        # copy when it changed, and inside an offloaded forward a layer's row of the slot map (_sync_slot_map).
        self._state_host = np.full((len(self.layers), E + capture), -1, dtype=np.int64)
        self._ready, self._capture_host = self._state_host[:, :E], self._state_host[:, E:]
        self._ready[...] = self.cache.table       # the initial placement's copies were waited for
        self._device_state = torch.tensor(self._state_host, device=self.device)     # a copy, on the CPU too
        self.slot_map = self._device_state[:, :E]
        self.capture_table = self._device_state[:, E:] if capture else None
        # two pinned copies of the state used in turn, each with the event of its last copy, waited for before the
        # copy is written again (two writes later: long done, so a guard rather than a wait)
        self._state_staging = (torch.empty((2, *self._state_host.shape), dtype=torch.int64, pin_memory=True)
                               if self.cuda else None)
        self._state_copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self._state_flip = 0
        self._state_dirty = False                 # the mirror differs from what the device state was last written
        # mapped path: the event recorded after the forward (end_forward), which bounds the host's wait for a layer's
        # routing and which the copies of its last layer's loads wait on
        self._forward_end: torch.cuda.Event | None = None
        self._mapped_buffers: dict[tuple[int, int], torch.Tensor] = {}     # (layer, tokens) -> routing buffer
        self._slot_staging = (torch.empty((len(self.layers), 2, self.config.num_experts), dtype=torch.int64,
                                          pin_memory=True) if self.cuda else None)
        self._slot_flip = [0] * len(self.layers)
        self._slots_changed.clear()               # the map was just built from the tables
        self._routing_events: dict[int, torch.cuda.Event] = {}
        # (layer, tokens, with the input, with a prediction) -> the buffers its routing is read back into and their
        # event: fixed, so that a graph replaying the read-back writes where the host step reads
        self._readback: dict[tuple, tuple] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._routing_log: list[tuple] = []       # all-resident path: (layer, ids) kept on device until the
                                                  # forward ends, then recorded in one transfer; mapped path:
                                                  # (layer, tokens), whose read-back end_forward takes
        # Set while a segmented CUDA graph is captured (decoding/graphs.py): called instead of run_offloaded.
        self.host_boundary = None
        self._overlap = False                     # inside overlapped(): host work queued (see there)
        self._deferred: list[tuple] = []

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
        self._slots_changed.add(layer)            # slots were taken for them (evicting others)
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
        self._last_copy = event
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

    def _grouped(self, layer, x, pair_slots, y_pairs, n_valid: int | None, host: bool = False) -> None:
        """Grouped compute of the pairs with a slot (>= 0) into their rows of y_pairs. n_valid=None writes every row
        (rows of pairs without a slot get unspecified values: a static shape for graphs); otherwise only the
        n_valid rows of the served pairs, leaving the others as they are. The fused kernels write the served
        rows only, either way; with `host`, a pair slot past the layer's (its first + capacity + e) names expert e's
        blob in the pinned store."""
        with self._section("gpu_experts"):
            base, pool = self._pool(layer)
            if self.fused_swiglu is not None:
                self.fused_swiglu(x, pair_slots, pool, self.hidden, self.inter, y_pairs, slot_base=base,
                                  host=self.store.blobs[self.layer_pos[layer]] if host else None)
                return
            k = pair_slots.shape[0] // x.shape[0]                 # pairs are token-major: T tokens x k experts
            pair_tokens = torch.arange(pair_slots.shape[0], device=x.device) // k
            order, y = grouped_swiglu(x, pair_tokens, pair_slots, pool, self.hidden, self.inter, slot_base=base)
            if n_valid is None or n_valid == pair_slots.shape[0]:
                y_pairs.index_copy_(0, order, y)
            else:
                y_pairs.index_copy_(0, order[:n_valid], y[:n_valid])

    def combine(self, y_pairs, weights, shared_out=None, cpu_share=None):
        """sum_k weights[t, k] * y_pairs[t * k + k'], in fp32, in routing order, in the model dtype; + shared_out
        (the shared expert's output) when given, as the model adds it. cpu_share: the pairs of a mapped layer's CPU
        share are taken from the CPU's rows (fused kernels only)."""
        if self.fused_combine is not None:
            return self.fused_combine(y_pairs, weights, shared_out, cpu_share=cpu_share)
        T, k = weights.shape
        out = (y_pairs.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(y_pairs.dtype)
        return out if shared_out is None else out + shared_out

    def use_shared_blob(self, layer: int, blob: torch.Tensor) -> None:
        """With shared_in_moe, `layer`'s shared expert is computed by the fused MoE kernels from `blob` (its weights
        in a routed expert's layout, SwiGLU.expert_blob) instead of by the callable run() gets."""
        if self.shared_in_moe:
            self.shared_blobs[layer] = blob

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared=None) -> torch.Tensor:
        """Output of one MoE layer: sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), + shared(x) when the layer has a
        shared expert (a callable on x). The manager runs the shared expert where it costs least: in the fused
        kernels of the layer's hits with shared_in_moe, else in an offloaded layer on the GPU while the host decides
        the misses."""
        if self.all_resident:
            y_pairs, shared_out = self._grouped_all(layer, x, ids, shared)     # every expert is resident: one wave
            self._routing_log.append((layer, ids))
            return self.combine(y_pairs, weights, shared_out)
        if self._mapped_now:
            return self.run_mapped(layer, x, ids, weights, shared)
        if self.host_boundary is not None:        # a segmented graph capture ends its segment here
            return self.host_boundary(layer, x, ids, weights, shared)
        return self.run_offloaded(layer, x, ids, weights, shared)

    @property
    def mapped_forward(self) -> bool:
        """The forward under way takes the mapped path (no host step)."""
        return self._mapped_now

    def run_mapped(self, layer, x, ids, weights, shared=None):
        """The mapped path: every pair is computed, a hit from its slot and a miss from its blob in the pinned store,
        and the routing is stored for the host on the way; no host step and no event, so a graph replays the whole
        forward as kernels only. The host takes the layer's routing once the forward is queued (end_forward: the
        policy's event and decision), and the loads it decides are copied once this layer's compute is done, for
        the next forwards."""
        # no prediction: the next layer's own decision comes from its real routing in the same forward, before any
        # prefetch could serve it (so `prefetch` decides as `lru` here)
        # The read-back is the alignment kernel's: it stores the routing into the layer's pinned buffer through its
        # mapped address, no copy node and no concatenation (a copy node cost a graph 6.7 us of GPU time and 1.7 us
        # of launch; benchmarks/graph_launch_probe.py, BENCHMARKS.md section 21). The host learns that the routing
        # landed from the buffer itself, which holds MAPPED_UNSET until the kernel overwrites every value
        # (_await_routing): no event a layer, whose record left the GPU idle about 10 us after each layer's compute
        # in the graph (BENCHMARKS.md section 23).
        routing = self._mapped_buffer(layer, ids.shape[0], ids.shape[1])
        self._readback[layer, x.shape[0], False, False, True] = ([routing], None, False, False)
        share = self._share_buffers(layer, x) if self.cpu_share else None
        y_pairs, shared_out = self._grouped_all(layer, x, ids, shared, mapped=True, routing=(weights, routing),
                                                cpu_share=share)
        self._routing_log.append((layer, x.shape[0]))
        if share is not None and not self.cuda:
            # no GPU to wait while the host works: the kernels ran already (interpreted), so the CPU's share is
            # computed now, before the combine reads it; _decide_mapped takes its experts from _shared_now
            ids_h, _ = _routing_of(routing.numpy())
            cpu = self._shared_now[layer] = self.residency.mapped_cpu_share(layer, ids_h)
            self._finish_share(share, self._start_share(layer, share, ids_h.reshape(-1), cpu), None)
        return self.combine(y_pairs, weights, shared_out, cpu_share=share)

    def _share_buffers(self, layer: int, x: torch.Tensor):
        """The CpuShare of (layer, tokens): fixed buffers, so that a graph replaying the forward uses the ones the
        host serves."""
        share = self._shares.get((layer, x.shape[0]))
        if share is None:
            from ..kernels.triton_moe import CpuShare

            T, k, pin = x.shape[0], self.config.top_k, self.cuda
            share = CpuShare(table=self._share_table,
                             x_rows=torch.zeros(T, self.hidden, dtype=x.dtype, pin_memory=pin),
                             pair_on_cpu=torch.zeros(T * k, dtype=torch.int32, device=self.device),
                             done=torch.zeros(1, dtype=torch.int32, pin_memory=pin),
                             row_of_pair=torch.full((T * k,), -1, dtype=torch.int32, pin_memory=pin),
                             rows=torch.zeros(T * k, self.hidden, dtype=torch.float32, pin_memory=pin),
                             errors=self._share_errors, capacity=self.cache.capacity)
            self._shares[layer, x.shape[0]] = share
        return share

    def _start_share(self, layer: int, share, flat: np.ndarray, cpu: list[int]):
        """Submit the CPU's share of a mapped layer (its experts `cpu`, the routing's ids `flat`) to the CPU kernel,
        on the input rows the alignment stored, writing share.rows; None when the share is empty."""
        if not cpu:
            return None
        pair_idx, token_idx, offsets, blobs, predicted = self._cpu_batch(layer, flat, cpu, share.x_rows.shape[0])
        n = len(pair_idx)
        submitted = time.perf_counter()
        job = self.cpu_kernel.submit(share.x_rows, token_idx, offsets, blobs, self.inter, share.rows[:n])
        share.row_of_pair.numpy()[pair_idx] = np.arange(n, dtype=np.int32)    # read once done is set
        return job, submitted, predicted

    def _finish_share(self, share, job, rec) -> None:
        """Wait for the CPU's share and tell the GPU its rows are there (share.done); its times into rec."""
        if job is None:
            return
        cpu_job, submitted, predicted = job
        kernel_s = cpu_job.wait()
        share.done.numpy()[0] = 1
        if rec is not None:
            rec.cpu_s += kernel_s
            rec.cpu_path_s += time.perf_counter() - submitted
            rec.cpu_s_model += predicted

    def shared_ahead(self, x, shared):
        """What the MoE layer passes to run() as its shared expert, called before the layer routes: on the one-graph
        forwards (all-resident, mapped) with a shared stream, the shared expert queued there now, beside the router,
        the alignment and the routed experts (small latency-bound kernels side by side); else `shared` itself, run
        where run() runs it (the offloaded path queues it behind its hits, and a segmented graph must not leave a
        fork open across a host step)."""
        if self.shared_stream is None or self.shared_in_moe or not (self.all_resident or self._mapped_now):
            return shared
        self.shared_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.shared_stream):
            return _Forked(shared(x), self.shared_stream)

    def _mapped_buffer(self, layer: int, tokens: int, top_k: int) -> torch.Tensor:
        """A mapped forward's routing buffer of (layer, tokens), _routing_buffer's layout, its own (the host round
        trip's copies never write it): every value MAPPED_UNSET except between the kernel's store and the host's
        read, which sets them back."""
        buf = self._mapped_buffers.get((layer, tokens))
        if buf is None:
            buf = torch.full((tokens, 3 * top_k), MAPPED_UNSET, dtype=torch.int32, pin_memory=self.cuda)
            self._mapped_buffers[layer, tokens] = buf
        return buf

    def _await_routing(self, routing: np.ndarray) -> None:
        """Until the alignment kernel's stores of a mapped forward's routing have all landed: no value is
        MAPPED_UNSET (an id's halves never are; a weight's bits only as a NaN of one pattern), or the forward has
        ended, after which whatever the buffer holds is its value (a NaN weight: the logits end the request)."""
        end = self._forward_end
        while (routing == MAPPED_UNSET).any():
            if end is None or end.query():
                return

    def run_offloaded(self, layer, x, ids, weights, shared=None):
        """The offloaded path, in four parts, so that a segmented CUDA graph (decoding/graphs.py) replays the two
        device parts and runs the two host parts eagerly between them:
          1. device: the routing's read-back is issued, then every pair whose expert is ready in the device slot map
             is computed, while the host waits only for the read-back and decides (hits cost no host decision);
          2. host: the policy decides the misses; copies and CPU jobs start; the first wave's loads get slots;
          3. device: the first wave's loads are computed (skipped when the layer loads nothing);
          4. host: further waves, prefetches for the next layer, statistics, the CPU jobs' results."""
        y_pairs, shared_out = self.begin_offloaded(layer, x, ids, weights, shared)
        load_slots = self._staging_device(f"load_slots{layer}", ids.numel())
        work = self.decide_offloaded(layer, x, load_slots)
        if work.loads_first:
            self.load_wave(layer, x, load_slots, y_pairs)
        self.end_offloaded(work, x, y_pairs)
        return self.combine(y_pairs, weights, shared_out)

    def begin_offloaded(self, layer, x, ids, weights, shared=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device part one: issue the routing's read-back into pinned buffers (with an event the host waits on), then
        compute every pair whose expert the device slot map holds, and the shared expert (`shared`, a callable on x,
        or None), queued behind them, before the host waits. Returns the pair outputs ([T*k, H]; rows of pairs
        served later are unspecified until then) and the shared expert's output (None without one)."""
        self._issue_readback(layer, x, ids, weights, cpu_input=self.policy.uses_cpu,
                             predict=self.policy.wants_prediction)
        return self._grouped_all(layer, x, ids, shared)

    def _routing_buffer(self, layer: int, tokens: int, top_k: int) -> torch.Tensor:
        """The pinned buffer a layer's routing of `tokens` rows is read back into: [T, 3k] int32, the ids' int64
        halves then the weights' fp32 bits (_read_routing). One a (layer, tokens), whichever graph or eager forward
        writes it."""
        return self._staging(f"routing{layer}.routing.{tokens}", (tokens, 3 * top_k), torch.int32)

    def _issue_readback(self, layer, x, ids, weights, cpu_input: bool, predict: bool) -> None:
        """The layer's routing (and with predict the next layer's predicted ids, with cpu_input the layer's input)
        copied to pinned buffers, with an event the host waits on (_read_routing). The ids and weights travel as one
        int32 tensor: a device-to-host copy costs a graph about 6.7 us of GPU time and 1.7 us of launch, a
        concatenation about 1 us. (The mapped path's alignment kernel writes the routing itself: run_mapped.)"""
        nxt = self.residency.next_layer(layer) if predict else None
        # Prefetch: the next layer's router on this layer's input, brought back in the same read-back.
        ids_next = self.predictors[nxt](x)[0] if nxt is not None else None
        routing = torch.cat([ids.to(torch.int64).contiguous().view(torch.int32),
                             weights.float().contiguous().view(torch.int32)], 1)
        tensors = [routing] + ([ids_next] if ids_next is not None else [])
        if cpu_input:
            tensors.append(x)                     # the CPU path's input, on the host with the routing
        # one set of buffers per (layer, tokens), whichever graph or eager forward writes them
        names = (["next"] if ids_next is not None else []) + (["x"] if cpu_input else [])
        bufs = [self._routing_buffer(layer, *ids.shape)] + [
            self._staging(f"routing{layer}.{name}.{t.shape[0]}", t.shape, t.dtype) for name, t in zip(names, tensors[1:])]
        for buf, t in zip(bufs, tensors):
            buf.copy_(t, non_blocking=self.cuda)
        ready = None
        if self.cuda:
            ready = self._external_event(self._routing_events, layer)
            ready.record()
        # by path too: a graph of one path replays its read-back without this code, so the other path's forward of
        # the same shape must not change what the host reads (or waits on) after it
        self._readback[layer, x.shape[0], cpu_input, predict, False] = (bufs, ready, ids_next is not None, cpu_input)

    @staticmethod
    def _external_event(events: dict, layer: int) -> torch.cuda.Event:
        """The layer's event in `events`, made once: external, so every replay of a graph that captured its record
        records it again."""
        event = events.get(layer)
        if event is None:
            event = events[layer] = torch.cuda.Event(external=True)
        return event

    def _read_routing(self, layer, tokens: int, mapped: bool = False):
        """The layer's routing (and the next layer's predicted ids, and its input for the CPU path) on the host:
        waits for the read-back begin_offloaded (or run_mapped) issued. Returns fresh arrays (a policy may keep
        them)."""
        key = (False, False, True) if mapped else (self.policy.uses_cpu, self.policy.wants_prediction, False)
        bufs, ready, has_prediction, has_input = self._readback[(layer, tokens, *key)]
        if ready is not None:
            ready.synchronize()
        routing = bufs[0].numpy()
        if mapped:
            self._await_routing(routing)
        ids, weights = _routing_of(routing)
        if mapped:
            routing.fill(MAPPED_UNSET)            # copied out: unset again for the next forward's stores
        predicted = bufs[1].numpy().copy() if has_prediction else None
        x_host = bufs[-1] if has_input else None
        return ids, weights, predicted, x_host

    def decide_offloaded(self, layer, x, load_slots: torch.Tensor) -> "OffloadedLayer":
        """Host part one: read the routing back, let the policy decide, start the CPU jobs, issue the first wave's
        copies and put each pair's slot in that wave (-1: computed already, or later) into load_slots."""
        wake = self.cpu_wake == "layer" and self._cpu_last_time.get((layer, len(x)), True)
        if self.cpu_kernel is not None and wake:
            self.cpu_kernel.hold(LAYER_HOLD_S)                         # before the routing's wait
        ids_h, weights_h, predicted, x_host = self._read_routing(layer, x.shape[0])
        flat = ids_h.reshape(-1)
        step = self.residency.begin_layer(layer, ids_h, weights_h, predicted)
        on_host = self.residency.cpu_on_host(step)     # mapped misses: the first wave reads them, not the CPU
        cpu = [] if on_host else step.decision.cpu
        self._cpu_last_time[layer, len(x)] = bool(cpu)
        cpu_job = self._start_cpu(layer, x_host, flat, cpu, copying=bool(step.decision.load)) if cpu else None
        waves = self.residency.waves(step)
        first = next(waves)
        # the first wave computes its loads, and the hits that were not ready in the device slot map (a prefetch's
        # copy the compute had not waited for yet)
        ready = self._ready[self.layer_pos[layer]]     # the device slot map the hits were computed with
        late_hits = [e for e in step.hits if ready[e] < 0]
        slots_np, n_valid = self._issue_wave(layer, flat, first, late_hits, on_host)
        if n_valid:       # through a pinned buffer of the layer's: the driver stages a copy from pageable memory
            staged = self._staging(f"load_slots_host{layer}", slots_np.shape, torch.int64)
            staged.copy_(torch.from_numpy(slots_np))
            load_slots.copy_(staged, non_blocking=True)
        self._sync_slot_map(layer)
        return OffloadedLayer(layer, flat, step, waves, cpu_job, loads_first=bool(n_valid))

    def load_wave(self, layer, x, load_slots, y_pairs) -> None:
        """Device part two: the first wave's loads (and with mapped misses the misses read from host memory), into
        their rows of y_pairs (every other row kept). Static shapes, so a graph replays it."""
        with self._section("gpu_experts"):
            if self.fused_swiglu is not None:              # writes the loads' rows only: no temporary, no select
                self._grouped(layer, x, load_slots, y_pairs, n_valid=None, host=self.mapped)
                return
            y = torch.empty_like(y_pairs)
            self._grouped(layer, x, load_slots, y, n_valid=None)
            torch.where((load_slots >= 0).unsqueeze(-1), y, y_pairs, out=y_pairs)

    def _pool(self, layer) -> tuple[int, torch.Tensor]:
        """The layer's first slot and its slots' rows of the pool."""
        base = self.layer_pos[layer] * self.cache.capacity
        return base, self.cache.pool[base:base + self.cache.capacity]

    def _grouped_all(self, layer, x, ids, shared=None, mapped: bool = False, routing=None, cpu_share=None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The grouped compute of every pair whose expert the device slot map holds, one output row per (token,
        expert) pair; rows of pairs without one are unspecified, or with `mapped` computed from the pinned store.
        The kernels and shapes do not depend on the routing, so a graph replays them. The fused kernels look the
        slots up in the map themselves; with routing = (weights, buffer) their alignment also writes the routing
        into the buffer (_routing_buffer's layout). Returns the pair outputs and the shared expert's output: from
        the same launches when the layer's blob is in shared_blobs, else shared(x) after them (None: no shared
        expert)."""
        flat = ids.reshape(-1)
        pos = self.layer_pos[layer]
        row = self.slot_map[pos]
        blob = self.shared_blobs.get(layer) if shared is not None else None
        rows = flat.shape[0] + (x.shape[0] if blob is not None else 0)      # the shared expert's rows last
        y = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        y_pairs = y[: flat.shape[0]]
        if self.fused_swiglu is not None:
            with self._section("gpu_experts"):
                base, pool = self._pool(layer)
                self.fused_swiglu(x, flat, pool, self.hidden, self.inter, y, slot_base=base, slot_map=row,
                                  host=self.store.blobs[pos] if mapped else None,
                                  capture=self.capture_table[pos] if mapped and self.capture_table is not None
                                  else None, routing=routing, shared=blob, cpu_share=cpu_share)
        else:
            self._grouped(layer, x, row.index_select(0, flat), y_pairs, n_valid=None)
        if blob is not None:
            return y_pairs, y[flat.shape[0]:]
        return y_pairs, shared(x) if shared is not None else None

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
        self._sync_slot_map(work.layer)
        nxt, wanted, slots = self.residency.prefetch(work.step)   # after this layer's copies: its misses go first
        if wanted:
            self._copy(nxt, wanted, slots)
            self._sync_slot_map(nxt)
        self.residency.end_layer(work.step)
        if work.cpu_job is not None:
            self._finish_cpu(work.cpu_job, y_pairs, work.step.rec)

    def _issue_wave(self, layer, flat, wave: Wave, late_hits=(), on_host=()) -> tuple[np.ndarray, int]:
        """Copy a wave's loads and make the compute wait for them; returns each pair's slot if its expert is one of
        the loads or `late_hits`, or the slot past the layer's that names its blob in host memory if it is one of
        `on_host` (-1: not computed in this wave), and the number of pairs served."""
        self._copy(layer, wave.loads, wave.slots)
        experts = wave.loads + list(late_hits)
        if not experts and not on_host:
            return np.empty(0, dtype=np.int64), 0
        slot_of = self.cache.resident(layer)
        lut = np.full(self.config.num_experts, -1, dtype=np.int64)     # this wave's experts -> slots
        lut[experts] = [slot_of[e] for e in experts]
        if on_host:
            lut[list(on_host)] = self._pool(layer)[0] + self.cache.capacity + np.asarray(on_host, dtype=np.int64)
        slots_np = lut[flat]
        valid = slots_np >= 0
        if self.cuda:
            self._wait_copies(slots_np[valid])
        self._slots_changed.add(layer)            # its experts are ready now
        return slots_np, int(valid.sum())

    def _slot_row(self, layer) -> np.ndarray:
        """The slot map's row of `layer` as the tables have it: its resident experts whose copies the compute has
        waited for (a prefetched expert is listed once a layer's compute waited for its copy)."""
        row = self.cache.table[self.layer_pos[layer]].copy()
        if self.pending_copy:
            row[np.isin(row, np.fromiter(self.pending_copy, np.int64, len(self.pending_copy)))] = -1
        return row

    def _sync_slot_map(self, layer) -> None:
        """Inside an offloaded forward: the device slot map's row of `layer`, copied when it changed."""
        if layer not in self._slots_changed:
            return
        self._slots_changed.discard(layer)
        pos = self.layer_pos[layer]
        row = self._slot_row(layer)
        if np.array_equal(row, self._ready[pos]):
            return
        self._ready[pos] = row
        if not self.cuda:
            self.slot_map[pos].copy_(torch.from_numpy(row))
            return
        # Two pinned rows per layer, used in turn: a row is written again only after the host waited for a later
        # read-back on the same stream (at most two updates of a layer's row come between two such waits: its own
        # decisions and finish), so its previous copy has completed.
        self._slot_flip[pos] ^= 1
        staging = self._slot_staging[pos, self._slot_flip[pos]]
        staging.copy_(torch.from_numpy(row))
        self.slot_map[pos].copy_(staging, non_blocking=True)

    def _mark_layer_done(self, layer) -> None:
        """The last compute that reads this layer's slots, so that a copy evicting one of them waits for it."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.layer_done[layer] = done

    # --------------------------------------------------------------------------------------------------- CPU
    def _cpu_batch(self, layer: int, flat: np.ndarray, cpu_experts: list[int], tokens: int):
        """A CPU job's batch: the pairs of cpu_experts among the routing's ids `flat` (token-major, `tokens` rows),
        grouped by expert with routing order inside. Returns (pair indices, their token indices, the jobs' offsets,
        the experts' blobs, the cost model's seconds for it (0 without one))."""
        pair_idx = np.nonzero(np.isin(flat, cpu_experts))[0]
        pair_idx = pair_idx[np.argsort(flat[pair_idx], kind="stable")]
        pair_exp = flat[pair_idx]
        job_experts, starts = np.unique(pair_exp, return_index=True)
        offsets = torch.from_numpy(np.append(starts, len(pair_exp)).astype(np.int64))
        predicted = 0.0
        if self.costs is not None:
            predicted = self.costs.cpu_jobs_seconds(int(n) for n in np.diff(offsets.numpy()))
        blobs = [self.store.blob(layer, int(e)) for e in job_experts]
        return pair_idx, torch.from_numpy(pair_idx // (flat.size // tokens)), offsets, blobs, predicted

    def _start_cpu(self, layer: int, x_host: torch.Tensor, flat: np.ndarray, cpu_experts: list[int], copying: bool):
        pair_idx, token_idx, offsets, blobs, predicted = self._cpu_batch(layer, flat, cpu_experts, x_host.shape[0])
        if self.costs is not None and copying:
            predicted *= self.costs.cpu_slowdown_with_copies
        out = self._staging("out", (len(pair_idx), self.hidden), torch.float32)
        submitted = time.perf_counter()
        # started on the kernel's own threads: this thread goes on with the layer's copies and GPU work
        job = self.cpu_kernel.submit(x_host, token_idx, offsets, blobs, self.inter, out)
        return job, submitted, torch.from_numpy(pair_idx), out, predicted

    def _staging_device(self, name: str, numel: int) -> torch.Tensor:
        """A reused int64 device buffer (the eager path's first-wave slots)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=torch.int64, device=self.device)
        return buf[:numel]

    def _staging(self, name: str, shape, dtype) -> torch.Tensor:
        """Reused host buffers for activations crossing PCIe (pinned on CUDA: no pageable copy in the hot path)."""
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self.cuda)
            self._buffers[name] = buf
        return buf[:numel].view(*shape)

    def _finish_cpu(self, job, y_pairs, rec) -> None:
        cpu_job, submitted, pair_idx, out, predicted = job
        with self._section("cpu_experts"):
            kernel_s = cpu_job.wait()       # the kernel's own time
        path_s = time.perf_counter() - submitted     # from submission to result: the workers' wake-up included
        rec.cpu_s += kernel_s
        rec.cpu_path_s += path_s
        rec.cpu_s_model += predicted
        if self.cpu_feedback is not None:
            self.cpu_feedback.observe(path_s, predicted)
        # Blocking copies, which drain the GPU's queue: with non-blocking ones (7eb7fac) oled's CPU jobs ran 1.85 x
        # longer on the H200 at 25 % on learned routing (BENCHMARKS.md section 14), the planner's decisions unchanged.
        # Not understood; a candidate is that the host then runs ahead of the GPU and the workers' hold
        # (LAYER_HOLD_S) ends before the next layer's job arrives.
        y_pairs.index_copy_(0, pair_idx.to(y_pairs.device), out.to(y_pairs.device, y_pairs.dtype))

    # ------------------------------------------------------------------------------------------ loop events
    # On the all-resident path nothing in a forward waits for the host, so inside `overlapped()` the host's share of
    # each forward (its start and its routing's statistics; the policy is told nothing there) is queued and done once
    # the loop has queued the next forward (`launched`), while the GPU runs it: in order, one forward late.
    @contextlib.contextmanager
    def overlapped(self):
        """A request's forwards, with the all-resident path's host work done behind the next forward; everything
        queued is done on the way out, error or not."""
        self._overlap = self.all_resident
        try:
            yield self
        finally:
            self._overlap = False
            self.flush()

    def launched(self) -> None:
        """The loop has queued a forward: do the host work queued before it. A mapped forward whose CPU share holds
        the workers (ShareHold) leaves it to _decide_mapped, which does it once the first layer's CPU job is under
        way: the GPU waits for that job's rows, not for the policy's bookkeeping."""
        if self._mapped_now and self._share_hold.held and self.cuda:
            return
        self.flush()

    def flush(self) -> None:
        deferred, self._deferred = self._deferred, []
        for work, arg in deferred:
            work(arg)

    def begin_forward(self, info: ForwardInfo) -> None:
        """A forward is about to be queued. What the device reads (the settled slot map, the path, the capture table)
        is set now, unless the last mapped forward's decisions set it already for a mapped one (_decide_mapped).
        The host's bookkeeping (the last iteration's event, this forward's start) waits behind the
        launch where nothing in the forward depends on it: on the all-resident path (statistics only), and on the
        mapped path, whose decisions are made from the routing read back after the launch (end_forward). A host round
        trip decides as the forward runs, so the bookkeeping is done first."""
        if self.mapped:
            self._mapped_now = self.residency.takes_mapped_path(info)
            if not (self._prepared and self._mapped_now):
                self._prepare_device(self._mapped_now)
            self._prepared = False
        if self._mapped_now and self.cpu_share and self._share_hold.begin() and self.cuda:
            self.cpu_kernel.hold(FORWARD_HOLD_S)  # awake when the first layer's share arrives, if the last had one
        if self._overlap or self._mapped_now:
            self._deferred.append((self._start_forward, info))
        else:
            self.flush()
            self._start_forward(info)

    def _prepare_device(self, mapped: bool, armed: set[int] | None = None) -> None:
        """The device state a forward reads: the slot map settled, and the capture table armed for a mapped one,
        written in one copy when it changed (one copy per changed layer took 0.63 ms of host time a forward for
        oled at 40 % on learned routing, where capture changes most layers' rows every forward; BENCHMARKS.md
        section 28). armed: the layers armed for this forward already (a mapped forward's decisions arm each as
        they go); None: every layer is armed here."""
        self._settle_slots()
        if self.capture_table is not None:
            rest = None if armed is None else [layer for layer in self.residency.layers if layer not in armed]
            self._arm_capture(self.residency.arm_capture(mapped, rest))
        if self._state_dirty:
            self._write_device_state()

    def _write_device_state(self) -> None:
        """The host's mirror of the device state (slot map and capture table) copied to the device in one copy,
        queued on the current stream: the next forward reads it, the forward before it read the old state."""
        self._state_dirty = False
        if not self.cuda:
            self._device_state.copy_(torch.from_numpy(self._state_host))
            return
        self._state_flip ^= 1
        staging, copied = self._state_staging[self._state_flip], self._state_copied[self._state_flip]
        copied.synchronize()
        staging.numpy()[...] = self._state_host
        self._device_state.copy_(staging, non_blocking=True)
        copied.record()

    def _start_forward(self, info: ForwardInfo) -> None:
        if self.all_resident:                     # nothing to decide: the policy hears of no forward
            self.residency.begin_resident_forward(info)
            return
        scale = self.cpu_feedback.next_scale() if self.cpu_feedback is not None else 1.0
        self.residency.begin_forward(info, cpu_scale=scale)
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(FORWARD_HOLD_S)

    def routing_mark(self) -> int:
        return len(self._routing_log)

    def take_routing(self, mark: int) -> list[tuple]:
        """Remove and return the routing logged since `mark` (a CUDA graph capture keeps it to hand back)."""
        taken = self._routing_log[mark:]
        del self._routing_log[mark:]
        return taken

    def log_routing(self, routing: list[tuple]) -> None:
        """Routing produced by a graph replay: the same device tensors every replay, read by end_forward."""
        self._routing_log.extend(routing)

    def end_forward(self) -> None:
        """Record the all-resident path's routing: one device-to-host copy of the ids per forward, into a pinned
        buffer; inside `overlapped()` it is recorded once the next forward is queued (the copy is ordered before that
        forward overwrites a graph's routing)."""
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(0.0)
        if self._mapped_now:
            self._mapped_now = False
            if self.cuda:                         # behind the forward (and the loop's prediction) on the stream
                self._forward_end = torch.cuda.Event()
                self._forward_end.record()
            self._decide_mapped()
            return
        if not self._routing_log:
            return
        self.flush()                          # an earlier forward's records first: they read the same buffers
        log, self._routing_log = self._routing_log, []
        layers = [layer for layer, _ in log]
        ids = torch.stack([ids for _, ids in log])
        host = self._staging(f"routing_log.ids.{tuple(ids.shape)}", ids.shape, ids.dtype)
        host.copy_(ids, non_blocking=self.cuda)
        copied = None
        if self.cuda:
            copied = torch.cuda.Event()
            copied.record()
        record = (layers, host, copied)
        if self._overlap:
            self._deferred.append((self._record_routing, record))
        else:
            self._record_routing(record)

    # ------------------------------------------------------------------------------------------ mapped path
    def _decide_mapped(self) -> None:
        """The policy's events and decisions for a forward that took the mapped path, layer by layer as its routing
        arrives: its misses were read from host memory already, so a decision's loads fill slots for the next
        forwards: as many as fit beside the layer's hits (one wave), copied once the layer's compute is done. The
        events carry no prediction of the next layer (run_mapped), so a decision has no prefetch."""
        log, self._routing_log = self._routing_log, []
        if self.cuda:
            for layer, _ in log:                  # the last compute that read these layers' slots
                self.layer_done[layer] = self._forward_end
        held = None                               # the last layer's loads, copied once its compute is done
        for layer, tokens in log:
            ids_h, weights_h, _, _ = self._read_routing(layer, tokens, mapped=True)
            # the CPU's share first: the GPU waits for its rows in this layer's combine
            cpu, job, share = None, None, None
            if self.cpu_share and self.cuda:
                cpu = self.residency.mapped_cpu_share(layer, ids_h)
                if self._share_hold.layer(cpu):
                    self.cpu_kernel.hold(FORWARD_HOLD_S)     # woken for this job, polling on for the next layers'
                share = self._shares[layer, tokens]
                job = self._start_share(layer, share, ids_h.reshape(-1), cpu)
            elif self.cpu_share:                  # served inside run_mapped already (no GPU to wait)
                cpu = self._shared_now.pop(layer)
                self._share_hold.layer(cpu)
            if self._deferred:                    # the bookkeeping launched() left (CPU share), while the job runs
                self.flush()
            if held is not None:
                # this layer's routing is stored by its first kernel, which the stream ran after the last layer's
                # compute: that compute, which read the victims' slots, is done, so the copies need not wait
                self._copy(*held, wait_layer=False)
            first = self.residency.decide_mapped(layer, ids_h, weights_h, cpu)
            self._finish_share(share, job, self.stats.records[-1])
            held = (layer, first.loads, first.slots)
            if self.stats.records[-1].experts_captured:      # captured experts in, their victims out of the map
                self._slots_changed.add(layer)
            if self.capture_table is not None:
                # the layer's slots are what the next forward starts with: armed now, while the GPU runs the layers
                # after it, not all at the end with the GPU idle (arming 19 layers there took about as long as
                # _prepare_device's other work)
                self._arm_capture(self.residency.arm_capture(True, [layer]))
        if held is not None:
            self._copy(*held)                     # waits for the forward's end (layer_done)
        # The next forward's device state, as for a mapped one (a denoising iteration follows most of them), set
        # now, while the GPU finishes this forward's last layers and its LM head, instead of before the next launch
        # with the GPU idle (begin_forward took 0.17 ms a forward for oled at 40 % with capture on the H200,
        # BENCHMARKS.md section 21). Queued on the stream behind this forward, so this forward reads the state it
        # started with; begin_forward redoes it for a forward of the other path.
        self._prepare_device(True, armed={layer for layer, _ in log})
        self._prepared = True
        if self.cpu_share:
            self._check_share()

    def _check_share(self) -> None:
        """After a mapped forward with a CPU share (its decisions made and the next forward's state queued): the
        workers may sleep again, and once the forward is done, a combine that stopped waiting for the CPU's rows
        (CpuShare.timeout_ns) fails it, since its outputs are then wrong (the loop reads them only after this)."""
        if self._share_hold.end() and self.cuda:
            self.cpu_kernel.hold(0.0)
        if self.cuda:
            self._forward_end.synchronize()
        errors = self._share_errors.numpy()
        if errors[0]:
            errors[0] = 0
            raise RuntimeError("a mapped forward's combine stopped waiting for the CPU's share of its misses "
                               "(no answer from the host within the timeout): its outputs are not used")

    def _arm_capture(self, armed: dict[int, list[int]]) -> None:
        """The capture table's mirror for the next forward: the rows of the layers armed (Residency.arm_capture),
        each its armed slots then -1; the others' rows as they were. Not on the mapped path: nothing reads it."""
        for layer, slots in armed.items():
            row = self._capture_host[self.layer_pos[layer]]
            n = len(slots)
            if row[:n].tolist() != slots or (row[n:] != -1).any():
                row[:n] = slots
                row[n:] = -1
                self._state_dirty = True

    def _settle_slots(self) -> None:
        """Before a forward: the compute waits for the copies decided since the last one, then the slot map's mirror
        is brought up to date for every layer that changed, so each forward starts with the slot tables and the map
        equal (once _prepare_device writes it)."""
        if self.cuda and self.pending_copy:       # the copy stream runs in order: its last event covers the others
            torch.cuda.current_stream(self.device).wait_event(self._last_copy)
        self.pending_copy.clear()
        # every resident is ready now: the map is the tables (kept as an array beside them, ExpertCache.table)
        if self._slots_changed and not np.array_equal(self.cache.table, self._ready):
            self._ready[...] = self.cache.table
            self._state_dirty = True
        self._slots_changed.clear()

    def _record_routing(self, record) -> None:
        layers, host, copied = record
        if copied is not None:
            copied.synchronize()
        for layer, ids in zip(layers, host.numpy()):
            self.residency.record_resident(layer, ids.copy())

    def on_iteration(self, event: IterationEvent) -> None:
        if self.all_resident:                     # nothing to decide (Residency.begin_resident_forward)
            return
        # on the mapped path behind the next launch (that forward does not decide as it runs, begin_forward): with
        # the host waiting on nothing else, the GPU would wait on the policy's bookkeeping between forwards
        if self.mapped:
            self._deferred.append((self.policy.on_iteration, event))
        else:
            self.policy.on_iteration(event)

    def on_request_start(self) -> None:
        # a mapped forward that an exception cut short left routing nobody read: unset, so no read takes it as new
        for buf in self._mapped_buffers.values():
            buf.numpy().fill(MAPPED_UNSET)        # made inside the forward's inference mode: written as NumPy
        self.policy.on_request_start()

    def close(self) -> None:
        """Wait for a CPU job that an exception left in flight: it reads and writes this manager's buffers."""
        if self.cpu_kernel is not None:
            self.cpu_kernel.drain()


def _routing_of(routing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A routing buffer's ids [T, k] int64 and weights [T, k] fp32, as fresh arrays: [T, 2k] int32 halves of the
    ids, then [T, k] fp32 bits (ExpertManager._routing_buffer's layout)."""
    k = routing.shape[1] // 3
    return routing[:, : 2 * k].copy().view(np.int64), routing[:, 2 * k:].copy().view(np.float32)


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
    loads_first: bool           # the first wave computes something (its loads, or hits not ready on the device)
