"""The host round trip: an offloaded layer whose misses the host decides while the GPU computes its hits.

Per layer: issue the routing's read-back and, without waiting for the host, compute every pair whose expert the
device slot map holds (the hits); meanwhile the host learns the routing, asks the policy which misses to load and
which to compute on the CPU, issues the layer's copies together on the copy stream and starts the CPU jobs; then
one grouped computation over the loaded slots (waiting only for this layer's copies), and the combine of every
(token, expert) output in routing order. The host's decisions overlap the hits' compute instead of holding the GPU
idle. The four parts (begin, decide, load_wave, finish) are also a segmented CUDA graph's hooks
(decoding/graphs.py): it replays the two device parts and runs the two host parts eagerly between them.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .compute import ExpertCompute
from .cpu_feedback import CpuCostFeedback
from .device_state import DeviceSlots, Staging
from .residency import LayerStep, Residency, Wave
from .store import ExpertStore
from .timer import Sections

# A woken CPU kernel's workers poll this long for the layer's job before they sleep (EngineConfig.cpu_wake "layer")
LAYER_HOLD_S = 0.001


def routing_of(routing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A routing buffer's ids [T, k] int64 and weights [T, k] fp32, as fresh arrays: [T, 2k] int32 halves of the
    ids, then [T, k] fp32 bits (RoundTrip.routing_buffer's layout, which the mapped path's alignment writes too)."""
    k = routing.shape[1] // 3
    return routing[:, : 2 * k].copy().view(np.int64), routing[:, 2 * k:].copy().view(np.float32)


def cpu_batch(store: ExpertStore, costs, layer: int, flat: np.ndarray, cpu_experts: list[int], tokens: int):
    """A CPU job's batch: the pairs of cpu_experts among the routing's ids `flat` (token-major, `tokens` rows),
    grouped by expert with routing order inside. Returns (pair indices, their token indices, the jobs' offsets,
    the experts' blobs, the cost model's seconds for it (0 without one))."""
    pair_idx = np.nonzero(np.isin(flat, cpu_experts))[0]
    pair_idx = pair_idx[np.argsort(flat[pair_idx], kind="stable")]
    pair_exp = flat[pair_idx]
    job_experts, starts = np.unique(pair_exp, return_index=True)
    offsets = torch.from_numpy(np.append(starts, len(pair_exp)).astype(np.int64))
    predicted = 0.0
    if costs is not None:
        predicted = costs.cpu_jobs_seconds(int(n) for n in np.diff(offsets.numpy()))
    blobs = [store.blob(layer, int(e)) for e in job_experts]
    return pair_idx, torch.from_numpy(pair_idx // (flat.size // tokens)), offsets, blobs, predicted


@dataclass
class OffloadedLayer:
    """What the host part one of an offloaded layer leaves for part two."""
    layer: int
    flat: np.ndarray            # routed expert ids, token-major [T*k]
    step: LayerStep
    waves: Iterator[Wave]       # the waves after the first
    cpu_job: tuple | None
    loads_first: bool           # the first wave computes something (its loads, or hits not ready on the device)


class RoundTrip:
    def __init__(self, store: ExpertStore, residency: Residency, slots: DeviceSlots, compute: ExpertCompute,
                 staging: Staging, sections: Sections, *, cpu_kernel, costs, cpu_wake: str,
                 cpu_feedback: CpuCostFeedback | None, predictors: dict, mapped: bool):
        """cpu_wake: resolved (layer, forward or off); predictors: layer -> its router (the model runner fills
        it), for the next layer's prediction; mapped: with mapped misses, the misses a policy sends to the CPU
        are read from host memory by the first wave instead."""
        self.store, self.residency, self.policy, self.stats = store, residency, residency.policy, residency.stats
        self.slots, self.compute, self.staging, self.sections = slots, compute, staging, sections
        self.cpu_kernel, self.costs, self.cpu_wake, self.cpu_feedback = cpu_kernel, costs, cpu_wake, cpu_feedback
        self.predictors, self.mapped = predictors, mapped
        self.cuda, self.hidden, self.inter = slots.cuda, store.hidden, store.intermediate
        self.layer_pos, self.num_experts = store.layer_pos, store.config.num_experts
        self.cpu_last_time: dict[tuple[int, int], bool] = {}   # (layer, rows) -> it had CPU work the last time
        self.routing_events: dict[int, torch.cuda.Event] = {}
        # (layer, tokens, with the input, with a prediction) -> the buffers its routing is read back into and their
        # event: fixed, so that a graph replaying the read-back writes where the host step reads
        self.readback: dict[tuple, tuple] = {}

    def run(self, layer, x, ids, weights, shared=None):
        """The offloaded path, in four parts, so that a segmented CUDA graph (decoding/graphs.py) replays the two
        device parts and runs the two host parts eagerly between them:
          1. device: the routing's read-back is issued, then every pair whose expert is ready in the device slot map
             is computed, while the host waits only for the read-back and decides (hits cost no host decision);
          2. host: the policy decides the misses; copies and CPU jobs start; the first wave's loads get slots;
          3. device: the first wave's loads are computed (skipped when the layer loads nothing);
          4. host: further waves, prefetches for the next layer, statistics, the CPU jobs' results."""
        y_pairs, shared_out = self.begin(layer, x, ids, weights, shared)
        load_slots = self.staging.device_int64(f"load_slots{layer}", ids.numel())
        work = self.decide(layer, x, load_slots)
        if work.loads_first:
            self.load_wave(layer, x, load_slots, y_pairs)
        self.finish(work, x, y_pairs)
        return self.compute.combine(y_pairs, weights, shared_out)

    def combine(self, y_pairs, weights, shared_out=None):
        return self.compute.combine(y_pairs, weights, shared_out)

    # --------------------------------------------------------------------------------------- device part one
    def begin(self, layer, x, ids, weights, shared=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device part one: issue the routing's read-back into pinned buffers (with an event the host waits on), then
        compute every pair whose expert the device slot map holds, and the shared expert (`shared`, a callable on x,
        or None), queued behind them, before the host waits. Returns the pair outputs ([T*k, H]; rows of pairs
        served later are unspecified until then) and the shared expert's output (None without one)."""
        self.issue_readback(layer, x, ids, weights, cpu_input=self.policy.uses_cpu,
                            predict=self.policy.wants_prediction)
        return self.compute.grouped_all(layer, x, ids, shared)

    def routing_buffer(self, layer: int, tokens: int, top_k: int) -> torch.Tensor:
        """The pinned buffer a layer's routing of `tokens` rows is read back into: [T, 3k] int32, the ids' int64
        halves then the weights' fp32 bits (routing_of). One a (layer, tokens), whichever graph or eager forward
        writes it."""
        return self.staging.host(f"routing{layer}.routing.{tokens}", (tokens, 3 * top_k), torch.int32)

    def issue_readback(self, layer, x, ids, weights, cpu_input: bool, predict: bool) -> None:
        """The layer's routing (and with predict the next layer's predicted ids, with cpu_input the layer's input)
        copied to pinned buffers, with an event the host waits on (read_routing). The ids and weights travel as one
        int32 tensor: a device-to-host copy costs a graph more than a concatenation. (The mapped path's alignment
        kernel writes the routing itself: MappedPath.run.)"""
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
        bufs = [self.routing_buffer(layer, *ids.shape)] + [
            self.staging.host(f"routing{layer}.{name}.{t.shape[0]}", t.shape, t.dtype)
            for name, t in zip(names, tensors[1:])]
        for buf, t in zip(bufs, tensors):
            buf.copy_(t, non_blocking=self.cuda)
        ready = None
        if self.cuda:
            ready = external_event(self.routing_events, layer)
            ready.record()
        self.readback[layer, x.shape[0], cpu_input, predict] = (bufs, ready, ids_next is not None, cpu_input)

    def read_routing(self, layer, tokens: int):
        """The layer's routing (and the next layer's predicted ids, and its input for the CPU path) on the host:
        waits for the read-back begin issued. Returns fresh arrays (a policy may keep them)."""
        key = (layer, tokens, self.policy.uses_cpu, self.policy.wants_prediction)
        bufs, ready, has_prediction, has_input = self.readback[key]
        if ready is not None:
            ready.synchronize()
        ids, weights = routing_of(bufs[0].numpy())
        predicted = bufs[1].numpy().copy() if has_prediction else None
        x_host = bufs[-1] if has_input else None
        return ids, weights, predicted, x_host

    # ------------------------------------------------------------------------------------------ host part one
    def decide(self, layer, x, load_slots: torch.Tensor) -> OffloadedLayer:
        """Host part one: read the routing back, let the policy decide, start the CPU jobs, issue the first wave's
        copies and put each pair's slot in that wave (-1: computed already, or later) into load_slots."""
        wake = self.cpu_wake == "layer" and self.cpu_last_time.get((layer, len(x)), True)
        if self.cpu_kernel is not None and wake:
            self.cpu_kernel.hold(LAYER_HOLD_S)                         # before the routing's wait
        ids_h, weights_h, predicted, x_host = self.read_routing(layer, x.shape[0])
        flat = ids_h.reshape(-1)
        step = self.residency.begin_layer(layer, ids_h, weights_h, predicted)
        on_host = self.residency.cpu_on_host(step)     # mapped misses: the first wave reads them, not the CPU
        cpu = [] if on_host else step.decision.cpu
        self.cpu_last_time[layer, len(x)] = bool(cpu)
        cpu_job = self.start_cpu(layer, x_host, flat, cpu, copying=bool(step.decision.load)) if cpu else None
        waves = self.residency.waves(step)
        first = next(waves)
        # the first wave computes its loads, and the hits that were not ready in the device slot map (a prefetch's
        # copy the compute had not waited for yet)
        ready = self.slots.ready[self.layer_pos[layer]]     # the device slot map the hits were computed with
        late_hits = [e for e in step.hits if ready[e] < 0]
        slots_np, n_valid = self.issue_wave(layer, flat, first, late_hits, on_host)
        if n_valid:       # through a pinned buffer of the layer's: the driver stages a copy from pageable memory
            staged = self.staging.host(f"load_slots_host{layer}", slots_np.shape, torch.int64)
            staged.copy_(torch.from_numpy(slots_np))
            load_slots.copy_(staged, non_blocking=True)
        self.slots.sync(layer)
        return OffloadedLayer(layer, flat, step, waves, cpu_job, loads_first=bool(n_valid))

    def issue_wave(self, layer, flat, wave: Wave, late_hits=(), on_host=()) -> tuple[np.ndarray, int]:
        """Copy a wave's loads and make the compute wait for them; returns each pair's slot if its expert is one of
        the loads or `late_hits`, or the slot past the layer's that names its blob in host memory if it is one of
        `on_host` (-1: not computed in this wave), and the number of pairs served."""
        self.slots.copy(layer, wave.loads, wave.slots)
        experts = wave.loads + list(late_hits)
        if not experts and not on_host:
            return np.empty(0, dtype=np.int64), 0
        cache = self.slots.cache
        slot_of = cache.resident(layer)
        lut = np.full(self.num_experts, -1, dtype=np.int64)     # this wave's experts -> slots
        lut[experts] = [slot_of[e] for e in experts]
        if on_host:
            lut[list(on_host)] = self.slots.pool(layer)[0] + cache.capacity + np.asarray(on_host, dtype=np.int64)
        slots_np = lut[flat]
        valid = slots_np >= 0
        if self.cuda:
            self.slots.wait_copies(slots_np[valid])
        self.slots.changed.add(layer)             # its experts are ready now
        return slots_np, int(valid.sum())

    # -------------------------------------------------------------------------------------- device part two
    def load_wave(self, layer, x, load_slots, y_pairs) -> None:
        """Device part two: the first wave's loads (and with mapped misses the misses read from host memory), into
        their rows of y_pairs (every other row kept). Static shapes, so a graph replays it."""
        with self.sections("gpu_experts"):
            if self.compute.fused_swiglu is not None:      # writes the loads' rows only: no temporary, no select
                self.compute.grouped(layer, x, load_slots, y_pairs, n_valid=None, host=self.mapped)
                return
            y = torch.empty_like(y_pairs)
            self.compute.grouped(layer, x, load_slots, y, n_valid=None)
            torch.where((load_slots >= 0).unsqueeze(-1), y, y_pairs, out=y_pairs)

    # ------------------------------------------------------------------------------------------ host part two
    def finish(self, work: OffloadedLayer, x, y_pairs) -> None:
        """Host part two: further waves (eagerly, into y_pairs), prefetches for the next layer, statistics, and the
        CPU jobs' results."""
        self.slots.mark_layer_done(work.layer)
        for wave in work.waves:
            slots_np, n_valid = self.issue_wave(work.layer, work.flat, wave)
            if n_valid:
                pair_slots = torch.from_numpy(slots_np).to(x.device, non_blocking=True)
                self.compute.grouped(work.layer, x, pair_slots, y_pairs, n_valid)
                self.slots.mark_layer_done(work.layer)
        self.slots.sync(work.layer)
        nxt, wanted, slots = self.residency.prefetch(work.step)   # after this layer's copies: its misses go first
        if wanted:
            self.slots.copy(nxt, wanted, slots)
            self.slots.sync(nxt)
        self.residency.end_layer(work.step)
        if work.cpu_job is not None:
            self.finish_cpu(work.cpu_job, y_pairs, work.step.rec)

    # ---------------------------------------------------------------------------------------------- CPU jobs
    def start_cpu(self, layer: int, x_host: torch.Tensor, flat: np.ndarray, cpu_experts: list[int], copying: bool):
        pair_idx, token_idx, offsets, blobs, predicted = cpu_batch(self.store, self.costs, layer, flat, cpu_experts,
                                                                   x_host.shape[0])
        if self.costs is not None and copying:
            predicted *= self.costs.cpu_slowdown_with_copies
        out = self.staging.host("out", (len(pair_idx), self.hidden), torch.float32)
        submitted = time.perf_counter()
        # started on the kernel's own threads: this thread goes on with the layer's copies and GPU work
        job = self.cpu_kernel.submit(x_host, token_idx, offsets, blobs, self.inter, out)
        return job, submitted, torch.from_numpy(pair_idx), out, predicted

    def finish_cpu(self, job, y_pairs, rec) -> None:
        cpu_job, submitted, pair_idx, out, predicted = job
        with self.sections("cpu_experts"):
            kernel_s = cpu_job.wait()       # the kernel's own time
        path_s = time.perf_counter() - submitted     # from submission to result: the workers' wake-up included
        rec.cpu_s += kernel_s
        rec.cpu_path_s += path_s
        rec.cpu_s_model += predicted
        if self.cpu_feedback is not None:
            self.cpu_feedback.observe(path_s, predicted)
        # Blocking copies, which drain the GPU's queue: with non-blocking ones the CPU jobs ran markedly longer on
        # the GPU machine, the planner's decisions unchanged. Not understood; a candidate is that the host then runs
        # ahead of the GPU and the workers' hold (LAYER_HOLD_S) ends before the next layer's job arrives.
        y_pairs.index_copy_(0, pair_idx.to(y_pairs.device), out.to(y_pairs.device, y_pairs.dtype))


def external_event(events: dict, layer: int) -> torch.cuda.Event:
    """The layer's event in `events`, made once: external, so every replay of a graph that captured its record
    records it again."""
    event = events.get(layer)
    if event is None:
        event = events[layer] = torch.cuda.Event(external=True)
    return event
