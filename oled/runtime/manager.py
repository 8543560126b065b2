"""ExpertManager: runs a MoE layer's routed experts from the GPU expert cache, the copy engine and the CPU.

A facade over one executor per path (each forward takes one):
  all-resident  every expert resident for good: no decision, no host round trip, one graph (resident.py)
  round trip    the host decides a layer's misses while the GPU computes its hits (round_trip.py)
  mapped        a denoising iteration reads its misses from host memory inside the forward and decides after it,
                with part of them on the CPU (mapped.py)
over the device state and copy stream (device_state.py) and the experts' compute (compute.py). The decoding side
talks to it through runtime/backend.py: ExpertBackend (forwards, iterations, a layer's run) and GraphHooks.
"""
from __future__ import annotations

import contextlib

import torch

from ..config import CPU_WAKE_MODES, CpuConfig, KernelConfig, OffloadConfig
from ..policies.base import Policy
from ..policies.contract import ForwardInfo, IterationEvent
from ..policies.costs import CostModel
from .budget import ExpertBudget
from .compute import ExpertCompute
from .cpu_feedback import CpuCostFeedback
from .device_state import DeviceSlots, Staging
from .expert_cache import ExpertCache
from .host_queue import HostQueue
from .mapped import FORWARD_HOLD_S, MappedPath
from .residency import Residency
from .resident import ResidentPath
from .round_trip import RoundTrip
from .stats import RunStats
from .store import ExpertStore
from .timer import SectionTimer, Sections

# How the CPU kernel's workers are ready for the engine's calls, one per layer with CPU work (EngineConfig.cpu_wake):
#   layer    woken when a layer's routing is read back, so that their wake-up overlaps the wait for the GPU, if the
#            layer had CPU work the last time it ran with as many rows (waking them for nothing slows the main
#            thread; a block's first forward carries the previous block's rows too, and needs more experts than the
#            block's other iterations); they poll for round_trip.LAYER_HOLD_S, then sleep
#   forward  polling through each forward (at most mapped.FORWARD_HOLD_S, which bounds an exception mid-forward)
#   off      woken by each call
#   auto     layer when the model runs on a CUDA device, off when it runs on the CPU: there the main thread's own
#            compute needs the cores the polling workers would take, and there is no GPU wait for their wake-up to
#            overlap
WAKE_MODES = CPU_WAKE_MODES


def check_cpu_wake(mode: str) -> None:
    if mode not in WAKE_MODES:
        raise ValueError(f"cpu_wake must be one of {', '.join(WAKE_MODES)}, got {mode!r}")


# Without settings the manager takes the plain paths: torch's expert GEMMs on the main stream, the host round trip
PLAIN_KERNELS = KernelConfig(fused_moe=False, shared_stream=False, shared_in_moe=False)
NO_MAPPED = OffloadConfig(mapped_misses=False, capture_slots=0, cpu_share=False)
CPU_DEFAULTS = CpuConfig()


class ExpertManager:
    def __init__(self, store: ExpertStore, budget: ExpertBudget, policy: Policy, device, cpu_kernel=None,
                 timer: SectionTimer | None = None, costs: CostModel | None = None,
                 kernels: KernelConfig = PLAIN_KERNELS, offload: OffloadConfig = NO_MAPPED,
                 cpu: CpuConfig = CPU_DEFAULTS):
        """kernels, offload, cpu: the engine's settings as resolved (Engine.set_runtime): whether the fused MoE
        kernels run, the shared expert's stream and kernels; the mapped path, its capture slots and CPU share; when
        the CPU kernel's workers wake and whether its costs follow its measured time."""
        fused_moe, shared_stream, shared_in_moe = bool(kernels.fused_moe), kernels.shared_stream, kernels.shared_in_moe
        mapped_misses, capture_slots, cpu_share = bool(offload.mapped_misses), offload.capture_slots, offload.cpu_share
        cpu_wake, cpu_cost_feedback = cpu.cpu_wake, cpu.cpu_cost_feedback
        self.store, self.policy, self.device = store, policy, torch.device(device)
        self.config, self.layers, self.layer_pos = store.config, store.layers, store.layer_pos
        self.hidden, self.inter = store.hidden, store.intermediate
        self.cache = ExpertCache(self.layers, budget, store.numel, store.blob_dtype, self.device,
                                 self.config.num_experts)
        self.stats = RunStats()
        self.sections = Sections(timer)
        self.cuda = self.device.type == "cuda"
        self.cpu_kernel = cpu_kernel
        self.costs = costs        # measured miss-service costs: each CPU job's predicted time is recorded beside its
                                  # measured time, so a run shows how well the model the planner relies on holds
        # each CPU job's time from submission to result against its predicted time: the planner's CPU terms follow
        # what the jobs take in the engine (EngineConfig.cpu_cost_feedback)
        self.cpu_feedback = CpuCostFeedback() if cpu_cost_feedback and cpu_kernel and costs is not None else None
        check_cpu_wake(cpu_wake)
        self.cpu_wake = ("layer" if self.cuda else "off") if cpu_wake == "auto" else cpu_wake
        if policy.uses_cpu and cpu_kernel is None:
            raise ValueError(f"policy {policy.name!r} computes misses on the CPU but no CPU expert kernel was given")
        # the experts' compute first: the fused kernels' block of pairs sizes the residency's mapped reads
        self.staging = Staging(self.device)
        self.compute = ExpertCompute(store, self.device, self.sections, fused_moe=fused_moe, shared_stream=shared_stream,
                                     shared_in_moe=shared_in_moe)
        # Host-side decisions (slot tables, policy calls, statistics), shared with the trace replayer.
        rows = self.compute.fused_swiglu_rows
        self.residency = Residency(self.cache, policy, self.stats, num_experts=self.config.num_experts,
                                   top_k=self.config.top_k, expert_bytes=store.expert_bytes, costs=costs,
                                   mapped_rows=rows if mapped_misses else 0,
                                   capture_slots=capture_slots if mapped_misses else 0,
                                   cpu_share=cpu_share and mapped_misses and cpu_kernel is not None)
        self.all_resident = self.residency.all_resident     # the forward needs no host step: one graph
        # EngineConfig.mapped_misses: a denoising iteration's misses are read by the fused kernels from the pinned
        # store inside the forward, so it needs no host step either (which forwards: Residency.takes_mapped_path).
        # On the host round trip (prefill, cache fills) the misses a policy sends to the CPU are read from host
        # memory by the first wave.
        self.mapped = bool(mapped_misses) and not self.all_resident
        if self.mapped and self.compute.fused_swiglu is None:
            raise ValueError("mapped misses are read by the fused MoE kernels: they need --fused-moe (Triton)")
        if self.mapped and self.cuda and not store.pinned:
            raise ValueError("mapped misses read the expert store over PCIe: it must be pinned (drop --no-pin)")
        # EngineConfig.capture_slots: on the mapped path the kernels write the misses they read from host memory
        # into the layer's armed slots (Residency.arm_capture), so a kept miss crosses PCIe once
        self.slots = DeviceSlots(store, self.residency, self.device, self.sections,
                                 self.residency.capture_slots if self.mapped else 0)
        self.compute.slots = self.slots
        self.queue = HostQueue()
        self.routing_log: list[tuple] = []   # all-resident path: (layer, ids) kept on device until the forward
                                             # ends; mapped path: (layer, tokens), whose routing end_forward takes
        self.predictors: dict[int, object] = {}             # layer -> router of that layer (for prefetch)
        self.resident = ResidentPath(self.residency, self.compute, self.staging, self.queue, self.routing_log,
                                     self.cuda)
        self.round_trip = RoundTrip(store, self.residency, self.slots, self.compute, self.staging, self.sections,
                                    cpu_kernel=cpu_kernel, costs=costs, cpu_wake=self.cpu_wake,
                                    cpu_feedback=self.cpu_feedback, predictors=self.predictors, mapped=self.mapped)
        # EngineConfig.cpu_share: a mapped forward's layers give part of their misses to the CPU kernel
        self.mapped_path = (MappedPath(store, self.residency, self.slots, self.compute, self.queue, self.routing_log,
                                       cpu_kernel=cpu_kernel, costs=costs,
                                       share_table=self.residency.cpu_share_table) if self.mapped else None)
        self.cpu_share = self.mapped_path is not None and self.mapped_path.cpu_share
        self._mapped_now = False                  # this forward takes the mapped path (begin_forward)
        self.graph_hooks = _GraphHooks(self)
        self.host_boundary = None                 # a segmented capture's host steps, instead of the round trip's run

    # ------------------------------------------------------------------------------------------ what it holds
    @property
    def timer(self) -> SectionTimer | None:
        return self.sections.timer

    @timer.setter
    def timer(self, timer: SectionTimer | None) -> None:
        self.sections.timer = timer               # a profiled pass sets it and unsets it

    @property
    def shared_in_moe(self) -> bool:
        return self.compute.shared_in_moe

    @property
    def shared_stream(self):
        return self.compute.shared_stream

    @property
    def mapped_forward(self) -> bool:
        """The forward under way takes the mapped path (no host step)."""
        return self._mapped_now

    def use_shared_blob(self, layer: int, blob: torch.Tensor) -> None:
        self.compute.use_shared_blob(layer, blob)

    # ---------------------------------------------------------------------------------------- a layer's run
    def shared_ahead(self, x, shared):
        return self.compute.shared_ahead(x, shared, one_graph=self.all_resident or self._mapped_now)

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared=None) -> torch.Tensor:
        """Output of one MoE layer: sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), + shared(x) when the layer has a
        shared expert (a callable on x), on the path of the forward under way."""
        if self.all_resident:
            return self.resident.run(layer, x, ids, weights, shared)
        if self._mapped_now:
            return self.mapped_path.run(layer, x, ids, weights, shared)
        if self.host_boundary is not None:        # a segmented graph capture ends its segment here
            return self.host_boundary(layer, x, ids, weights, shared)
        return self.round_trip.run(layer, x, ids, weights, shared)

    # ------------------------------------------------------------------------------------------ loop events
    # On the all-resident path nothing in a forward waits for the host, so inside `overlapped()` the host's share of
    # each forward (its start and its routing's statistics; the policy is told nothing there) is queued and done once
    # the loop has queued the next forward (`launched`), while the GPU runs it: in order, one forward late.
    @contextlib.contextmanager
    def overlapped(self):
        """A request's forwards, with the all-resident path's host work done behind the next forward; everything
        queued is done on the way out, error or not."""
        self.queue.overlap = self.all_resident
        try:
            yield self
        finally:
            self.queue.overlap = False
            self.flush()

    def launched(self) -> None:
        """The loop has queued a forward: do the host work queued before it. A mapped forward whose CPU share holds
        the workers (ShareHold) leaves it to MappedPath.decide, which does it once the first layer's CPU job is under
        way: the GPU waits for that job's rows, not for the policy's bookkeeping."""
        if self._mapped_now and self.mapped_path.share_hold.held and self.cuda:
            return
        self.flush()

    def flush(self) -> None:
        self.queue.flush()

    def begin_forward(self, info: ForwardInfo) -> None:
        """A forward is about to be queued. What the device reads (the settled slot map, the path, the capture table)
        is set now, unless the last mapped forward's decisions set it already for a mapped one (MappedPath.decide).
        The host's bookkeeping (the last iteration's event, this forward's start) waits behind the launch where
        nothing in the forward depends on it: on the all-resident path (statistics only), and on the mapped path,
        whose decisions are made from the routing read back after the launch (end_forward). A host round trip
        decides as the forward runs, so the bookkeeping is done first."""
        if self.mapped:
            self._mapped_now = self.mapped_path.begin_forward(info)
        if self.queue.overlap or self._mapped_now:
            self.queue.defer(self._start_forward, info)
        else:
            self.flush()
            self._start_forward(info)

    def _start_forward(self, info: ForwardInfo) -> None:
        if self.all_resident:                     # nothing to decide: the policy hears of no forward
            self.resident.begin_forward(info)
            return
        scale = self.cpu_feedback.next_scale() if self.cpu_feedback is not None else 1.0
        self.residency.begin_forward(info, cpu_scale=scale)
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(FORWARD_HOLD_S)

    def end_forward(self) -> None:
        """The forward is queued: a mapped forward's decisions, or the all-resident path's routing recorded."""
        if self.cpu_kernel is not None and self.cpu_wake == "forward":
            self.cpu_kernel.hold(0.0)
        if self._mapped_now:
            self._mapped_now = False
            self.mapped_path.end_forward()
            return
        if not self.routing_log:
            return
        self.resident.end_forward()

    def on_iteration(self, event: IterationEvent) -> None:
        if self.all_resident:                     # nothing to decide (Residency.begin_resident_forward)
            return
        # on the mapped path behind the next launch (that forward does not decide as it runs, begin_forward): with
        # the host waiting on nothing else, the GPU would wait on the policy's bookkeeping between forwards
        if self.mapped:
            self.queue.defer(self.policy.on_iteration, event)
        else:
            self.policy.on_iteration(event)

    def on_request_start(self) -> None:
        if self.mapped_path is not None:
            self.mapped_path.on_request_start()
        self.policy.on_request_start()

    def close(self) -> None:
        """Wait for a CPU job that an exception left in flight: it reads and writes this manager's buffers."""
        if self.cpu_kernel is not None:
            self.cpu_kernel.drain()


class _Captured:
    def __init__(self) -> None:
        self.routing: list = []


class _GraphHooks:
    """The manager as decoding/graphs.py sees it (runtime/backend.py GraphHooks)."""

    def __init__(self, manager: ExpertManager):
        self.manager, self.segments = manager, manager.round_trip

    def path(self) -> bool:
        return self.manager.mapped_forward

    @contextlib.contextmanager
    def capture(self, boundary=None):
        log, mark = self.manager.routing_log, len(self.manager.routing_log)
        captured = _Captured()
        self.manager.host_boundary = boundary
        try:
            yield captured
        except BaseException:
            del log[mark:]                        # a failed capture's routing is nobody's
            raise
        finally:
            self.manager.host_boundary = None
        captured.routing = log[mark:]             # logged while capturing; handed back after every replay
        del log[mark:]
        self.replayed(captured.routing)

    def replayed(self, routing: list) -> None:
        """Routing produced by a graph replay: the same device tensors every replay, read by end_forward."""
        self.manager.routing_log.extend(routing)
