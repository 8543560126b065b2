"""The mapped path: a denoising iteration with no host step (EngineConfig.mapped_misses).

Every pair is computed inside the forward, a hit from its slot and a miss from its blob in the pinned store (the
fused kernels read it over PCIe), and the alignment kernel stores the routing into a pinned buffer on the way, so a
graph replays the whole forward as kernels only. Once the forward is queued the host takes each layer's routing as
it lands (end_forward): the policy's event and decision, whose loads fill slots for the next forwards, copied once
the layer's compute is done. With a CPU share (EngineConfig.cpu_share) a layer gives part of its misses to the CPU
kernel, which computes them while the GPU reads the rest, and the layer's combine waits for the CPU's rows
(runtime/cpu_share.py).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .compute import ExpertCompute
from .cpu_share import ShareHold
from .device_state import DeviceSlots
from .host_queue import HostQueue
from .residency import Residency
from .round_trip import cpu_batch, routing_of
from .store import ExpertStore

# A mapped forward's routing buffer before the kernel's store: no id's half is -1, and a weight only as one NaN
MAPPED_UNSET = -1
# The CPU kernel's workers poll through a forward at most this long (bounds an exception mid-forward)
FORWARD_HOLD_S = 1.0


class MappedPath:
    def __init__(self, store: ExpertStore, residency: Residency, slots: DeviceSlots, compute: ExpertCompute,
                 queue: HostQueue, routing_log: list, *, cpu_kernel, costs, share_table):
        """share_table: Residency.cpu_share_table (None: no CPU share); routing_log: the forward's (layer, tokens),
        taken by end_forward (shared with the graph hooks)."""
        self.store, self.residency, self.stats = store, residency, residency.stats
        self.slots, self.compute, self.queue, self.routing_log = slots, compute, queue, routing_log
        self.cpu_kernel, self.costs = cpu_kernel, costs
        self.device, self.cuda = slots.device, slots.cuda
        self.hidden, self.inter, self.top_k = store.hidden, store.intermediate, store.config.top_k
        self.prepared = False                     # the next forward's device state is set for the mapped path
        # the event recorded after the forward (end_forward), which bounds the host's wait for a layer's routing and
        # which the copies of its last layer's loads wait on
        self.forward_end: torch.cuda.Event | None = None
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}     # (layer, tokens) -> routing buffer
        # the CPU share: the alignment's rule over the table, the buffers of CpuShare per (layer, tokens)
        self.cpu_share = share_table is not None
        self.share_table = torch.tensor(share_table, dtype=torch.int32, device=self.device) if self.cpu_share else None
        self.shares: dict[tuple[int, int], object] = {}
        self.share_errors = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda) if self.cpu_share else None
        self.shared_now: dict[int, list[int]] = {}   # without CUDA: layer -> the CPU experts served inside run
        self.share_hold = ShareHold()

    def begin_forward(self, info) -> bool:
        """Whether the forward takes the mapped path; the device state it reads set, unless the last mapped
        forward's decisions set it already for a mapped one (decide)."""
        now = self.residency.takes_mapped_path(info)
        if not (self.prepared and now):
            self.slots.prepare(now)
        self.prepared = False
        if now and self.cpu_share and self.share_hold.begin() and self.cuda:
            self.cpu_kernel.hold(FORWARD_HOLD_S)  # awake when the first layer's share arrives, if the last had one
        return now

    def run(self, layer, x, ids, weights, shared=None):
        """Every pair computed, the routing stored for the host on the way; no host step and no event. The host takes
        the layer's routing once the forward is queued (end_forward: the policy's event and decision), and the
        loads it decides are copied once this layer's compute is done, for the next forwards."""
        # no prediction: the next layer's own decision comes from its real routing in the same forward, before any
        # prefetch could serve it (so `prefetch` decides as `lru` here)
        # The read-back is the alignment kernel's: it stores the routing into the layer's pinned buffer through its
        # mapped address, no copy node and no concatenation. The host learns that the routing landed from the buffer
        # itself, which holds MAPPED_UNSET until the kernel overwrites every value (await_routing): no event a
        # layer, whose record would leave the GPU idle after each layer's compute in the graph.
        routing = self.buffer(layer, ids.shape[0], ids.shape[1])
        share = self.share_buffers(layer, x) if self.cpu_share else None
        y_pairs, shared_out = self.compute.grouped_all(layer, x, ids, shared, mapped=True, routing=(weights, routing),
                                                       cpu_share=share)
        self.routing_log.append((layer, x.shape[0]))
        if share is not None and not self.cuda:
            # no GPU to wait while the host works: the kernels ran already (interpreted), so the CPU's share is
            # computed now, before the combine reads it; decide takes its experts from shared_now
            ids_h, _ = routing_of(routing.numpy())
            cpu = self.shared_now[layer] = self.residency.mapped_cpu_share(layer, ids_h)
            self.finish_share(share, self.start_share(layer, share, ids_h.reshape(-1), cpu), None)
        return self.compute.combine(y_pairs, weights, shared_out, cpu_share=share)

    def buffer(self, layer: int, tokens: int, top_k: int) -> torch.Tensor:
        """A mapped forward's routing buffer of (layer, tokens), RoundTrip.routing_buffer's layout, its own (the host
        round trip's copies never write it): every value MAPPED_UNSET except between the kernel's store and the
        host's read, which sets them back."""
        buf = self.buffers.get((layer, tokens))
        if buf is None:
            buf = torch.full((tokens, 3 * top_k), MAPPED_UNSET, dtype=torch.int32, pin_memory=self.cuda)
            self.buffers[layer, tokens] = buf
        return buf

    def await_routing(self, routing: np.ndarray) -> None:
        """Until the alignment kernel's stores of a mapped forward's routing have all landed: no value is
        MAPPED_UNSET (an id's halves never are; a weight's bits only as a NaN of one pattern), or the forward has
        ended, after which whatever the buffer holds is its value (a NaN weight: the logits end the request)."""
        end = self.forward_end
        while (routing == MAPPED_UNSET).any():
            if end is None or end.query():
                return

    def read_routing(self, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's routing on the host, as fresh arrays, once the kernel stored it; the buffer is unset again
        for the next forward's stores."""
        routing = self.buffers[layer, tokens].numpy()
        self.await_routing(routing)
        ids, weights = routing_of(routing)
        routing.fill(MAPPED_UNSET)                # copied out: unset again for the next forward's stores
        return ids, weights

    def on_request_start(self) -> None:
        # a mapped forward that an exception cut short left routing nobody read: unset, so no read takes it as new
        for buf in self.buffers.values():
            buf.numpy().fill(MAPPED_UNSET)        # made inside the forward's inference mode: written as NumPy

    # ---------------------------------------------------------------------------------------- the host's part
    def end_forward(self) -> None:
        if self.cuda:                             # behind the forward (and the loop's prediction) on the stream
            self.forward_end = torch.cuda.Event()
            self.forward_end.record()
        self.decide()

    def decide(self) -> None:
        """The policy's events and decisions for a forward that took the mapped path, layer by layer as its routing
        arrives: its misses were read from host memory already, so a decision's loads fill slots for the next
        forwards: as many as fit beside the layer's hits (one wave), copied once the layer's compute is done. The
        events carry no prediction of the next layer (run), so a decision has no prefetch."""
        log = self.routing_log[:]
        self.routing_log.clear()
        if self.cuda:
            for layer, _ in log:                  # the last compute that read these layers' slots
                self.slots.layer_done[layer] = self.forward_end
        held = None                               # the last layer's loads, copied once its compute is done
        for layer, tokens in log:
            ids_h, weights_h = self.read_routing(layer, tokens)
            # the CPU's share first: the GPU waits for its rows in this layer's combine
            cpu, job, share = None, None, None
            if self.cpu_share and self.cuda:
                cpu = self.residency.mapped_cpu_share(layer, ids_h)
                if self.share_hold.layer(cpu):
                    self.cpu_kernel.hold(FORWARD_HOLD_S)     # woken for this job, polling on for the next layers'
                share = self.shares[layer, tokens]
                job = self.start_share(layer, share, ids_h.reshape(-1), cpu)
            elif self.cpu_share:                  # served inside run already (no GPU to wait)
                cpu = self.shared_now.pop(layer)
                self.share_hold.layer(cpu)
            if self.queue.deferred:               # the bookkeeping launched() left (CPU share), while the job runs
                self.queue.flush()
            if held is not None:
                # this layer's routing is stored by its first kernel, which the stream ran after the last layer's
                # compute: that compute, which read the victims' slots, is done, so the copies need not wait
                self.slots.copy(*held, wait_layer=False)
            first = self.residency.decide_mapped(layer, ids_h, weights_h, cpu)
            self.finish_share(share, job, self.stats.records[-1])
            held = (layer, first.loads, first.slots)
            if self.stats.records[-1].experts_captured:      # captured experts in, their victims out of the map
                self.slots.changed.add(layer)
            if self.slots.capture_table is not None:
                # the layer's slots are what the next forward starts with: armed now, while the GPU runs the layers
                # after it, not all at the end with the GPU idle
                self.slots.arm_capture(self.residency.arm_capture(True, [layer]))
        if held is not None:
            self.slots.copy(*held)                # waits for the forward's end (layer_done)
        # The next forward's device state, as for a mapped one (a denoising iteration follows most of them), set
        # now, while the GPU finishes this forward's last layers and its LM head, instead of before the next launch
        # with the GPU idle. Queued on the stream behind this forward, so this forward reads the state it started
        # with; begin_forward redoes it for a forward of the other path.
        self.slots.prepare(True, armed={layer for layer, _ in log})
        self.prepared = True
        if self.cpu_share:
            self.check_share()

    def check_share(self) -> None:
        """After a mapped forward with a CPU share (its decisions made and the next forward's state queued): the
        workers may sleep again, and once the forward is done, a combine that stopped waiting for the CPU's rows
        (CpuShare.timeout_ns) fails it, since its outputs are then wrong (the loop reads them only after this)."""
        if self.share_hold.end() and self.cuda:
            self.cpu_kernel.hold(0.0)
        if self.cuda:
            self.forward_end.synchronize()
        errors = self.share_errors.numpy()
        if errors[0]:
            errors[0] = 0
            raise RuntimeError("a mapped forward's combine stopped waiting for the CPU's share of its misses "
                               "(no answer from the host within the timeout): its outputs are not used")

    # ------------------------------------------------------------------------------------------- the CPU share
    def share_buffers(self, layer: int, x: torch.Tensor):
        """The CpuShare of (layer, tokens): fixed buffers, so that a graph replaying the forward uses the ones the
        host serves."""
        share = self.shares.get((layer, x.shape[0]))
        if share is None:
            from ..kernels.triton_moe import CpuShare       # Triton: the mapped path runs the fused kernels

            T, k, pin = x.shape[0], self.top_k, self.cuda
            share = CpuShare(table=self.share_table,
                             x_rows=torch.zeros(T, self.hidden, dtype=x.dtype, pin_memory=pin),
                             pair_on_cpu=torch.zeros(T * k, dtype=torch.int32, device=self.device),
                             done=torch.zeros(1, dtype=torch.int32, pin_memory=pin),
                             row_of_pair=torch.full((T * k,), -1, dtype=torch.int32, pin_memory=pin),
                             rows=torch.zeros(T * k, self.hidden, dtype=torch.float32, pin_memory=pin),
                             errors=self.share_errors, capacity=self.slots.cache.capacity)
            self.shares[layer, x.shape[0]] = share
        return share

    def start_share(self, layer: int, share, flat: np.ndarray, cpu: list[int]):
        """Submit the CPU's share of a mapped layer (its experts `cpu`, the routing's ids `flat`) to the CPU kernel,
        on the input rows the alignment stored, writing share.rows; None when the share is empty."""
        if not cpu:
            return None
        pair_idx, token_idx, offsets, blobs, predicted = cpu_batch(self.store, self.costs, layer, flat, cpu,
                                                                   share.x_rows.shape[0])
        n = len(pair_idx)
        submitted = time.perf_counter()
        job = self.cpu_kernel.submit(share.x_rows, token_idx, offsets, blobs, self.inter, share.rows[:n])
        share.row_of_pair.numpy()[pair_idx] = np.arange(n, dtype=np.int32)    # read once done is set
        return job, submitted, predicted

    def finish_share(self, share, job, rec) -> None:
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
